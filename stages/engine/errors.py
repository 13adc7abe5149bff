"""The one exception type users see: its message is the whole report, one line."""


class UserError(Exception):
    """Bad input (recipe, data, store state). Printed as one line; nothing in the store changes."""
