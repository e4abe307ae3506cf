"""The one exception type a bad request raises; the server turns it into HTTP 400."""


class InvalidRequestError(ValueError):
    """A request field is wrong. `field` names it so the client knows what to fix."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")
