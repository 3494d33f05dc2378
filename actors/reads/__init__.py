"""The read core shared by both fronts (the web front's routes and the MCP tools).

:mod:`actors.reads.rows` turns corpus rows into SPEC §3's representations; :mod:`actors.reads.queries`
holds every read's plan and runs it against the database, returning representations and the paging
facts a front needs to render its own links or cursors.
"""
