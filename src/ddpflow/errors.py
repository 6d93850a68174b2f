"""The one exception type for mistakes a user can fix (bad config, missing data, ...).

The CLI prints its message on one line and exits non-zero, without a traceback.
Anything else that escapes is a bug in ddpflow and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's input; the message says what is wrong and what to do."""

    exit_code = 2


def short(value, limit: int = 80) -> str:
    """repr() capped: a message never prints a whole huge value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ..."
