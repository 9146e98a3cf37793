"""The one exception type users see: the CLI prints its message on one line and exits non-zero."""


class OptquantError(Exception):
    """Bad input (config, corpus, checkpoint): the message says what and where, in one line."""
