"""Errors a user can fix: bad config values, files or inputs. The CLI prints them briefly."""


class UserError(ValueError):
    """Bad input; the message names the field, key path or file at fault."""


class ConfigError(UserError):
    """A config value or file is invalid; the message names the key path and its source."""
