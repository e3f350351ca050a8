"""The one exception type for bad user input: the CLI prints its message as one line and exits 2."""


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, malformed row); shown without a traceback."""
