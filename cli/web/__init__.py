"""``stepfs serve``: a local web page of a workspace's history (a front end
beside the CLI; it reads history only through ``store`` and the client
library, as the CLI does, and writes only through ``manage.rollback``)."""
