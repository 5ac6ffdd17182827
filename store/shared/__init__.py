"""A shared history: several workspaces (machines, containers) stepping into
one named history kept in PostgreSQL (or, for one machine and the contract
tests, an SQLite file).

The local SQLite store in ``WORKSPACE/.stepfs/`` stays each workspace's
working store, and a mount's request path never touches the network; the
shared history holds content-addressed objects, layers with their entries
and the workspace and host that made each, and one head per history.
``store/FORMAT.md`` ("Shared history") gives the schema and the ordering.

* ``url``: the one place a history URL (``--history``, ``STEPFS_HISTORY``) is parsed;
* ``tables``: the shared schema;
* ``remote``: the shared side (connection, uploads, the head's compare-and-swap, reads, verify);
* ``logread``: ``stepfs log``'s one query, and its read through psycopg alone (no SQLAlchemy);
* ``attachment``: what a workspace records about its history;
* ``transfer``: local objects and entries to and from the shared ones;
* ``sync``: attach, pull (take other workspaces' layers), push (publish own layers), clone;
* ``reads``: ``cat`` and ``diff`` of the history's own layers;
* ``rollback``: a workspace back to a shared layer's state, as a layer to publish;
* ``gc``: the objects no layer names, deleted;
* ``prune``: retention, the layers dropped folded into the oldest kept one;
* ``catchup``: a pull of a workspace whose position was pruned.
"""
