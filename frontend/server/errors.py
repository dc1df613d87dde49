"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status
that says what went wrong (vLLM's names for the types)."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

# status -> the error "type" OpenAI's API (and vLLM) put in the body
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.BAD_GATEWAY: "BadGatewayError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to answer with: its status, message and (optionally) the request field at fault."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = HTTPStatus(status)
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, self.status.phrase),
                          "param": self.param, "code": int(self.status)}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == HTTPStatus.UNAUTHORIZED else None
        return JSONResponse(self.body(), status_code=int(self.status), headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param)
