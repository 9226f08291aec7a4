"""Errors in the OpenAI API's shape: {"error": {"message", "type", "param", "code"}} with the HTTP status."""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               503: "service_unavailable_error", 500: "internal_server_error"}  # fmt: skip


class APIError(Exception):
    """A request the server answers with an error body (status 400, 401, 404, 503, 500)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
