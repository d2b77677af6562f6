"""Domain errors; the API maps them to status codes (404, 409, 422) with the message as detail."""


class NotFoundError(LookupError):
    pass


class ConflictError(ValueError):
    pass


class BadInputError(ValueError):
    pass
