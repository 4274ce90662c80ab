"""OpenAI-shaped errors: one exception type, its JSON body, and the app's exception handlers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cobatch.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"

_TYPE_OF_STATUS = {400: INVALID_REQUEST, 401: AUTHENTICATION, 404: NOT_FOUND, 405: INVALID_REQUEST,
                   413: INVALID_REQUEST, 415: INVALID_REQUEST, 429: RATE_LIMIT, 500: SERVER_ERROR,
                   503: UNAVAILABLE}


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_OF_STATUS.get(status, INVALID_REQUEST)
        self.headers = headers

    def body(self) -> dict[str, object]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        info = ErrorInfo(message=self.message, type=self.error_type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 for invalid input."""
    return APIError(400, message, param=param)


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    """A JSONResponse with an OpenAI error body (for middleware that cannot raise)."""
    return APIError(status, message, code=code).response()


def _param_of(loc: tuple[object, ...]) -> str | None:
    # FastAPI locations start with "body"; OpenAI's `param` is the field path inside it.
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = _param_of(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "extra_forbidden":
        message = f"unknown or unsupported field {param!r}"
    elif param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves as an OpenAI-shaped body with the right status."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return APIError(500, f"internal server error: {type(exc).__name__}").response()
