"""The server's error reply: an HTTP status with OpenAI's error body."""


class APIError(Exception):
    """An error reply: HTTP status plus OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (message, param, status,
                                                                       type, code)

    def body(self) -> dict:
        return {"error": {"message": _printable(self.message), "type": self.type,
                          "param": None if self.param is None else _printable(self.param),
                          "code": self.code}}


def _printable(text: str) -> str:
    """Text safe to send as UTF-8: a lone surrogate quoted from the request becomes \\ud800."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
