"""Errors on the OpenAI routes, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from aiohttp import web

OPENAI_PATH_PREFIXES = ("/v1/models", "/v1/completions", "/v1/chat/", "/v1/files", "/v1/batches")

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATH_PREFIXES)


class OpenAIError(Exception):
    """A request the OpenAI routes refuse; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return openai_error_response(self.status, self.message, param=self.param, code=self.code,
                                     headers=headers or None)


def invalid(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)


def unsupported(param: str, why: str = "is not supported by this server") -> OpenAIError:
    return OpenAIError(400, f"Unsupported parameter: '{param}' {why}.", param=param, code="unsupported_parameter")


def openai_error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                          headers: dict[str, str] | None = None) -> web.Response:
    kind = _TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)
