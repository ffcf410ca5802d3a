"""The ``dcp-ext`` command line tool."""
