"""The Sequin view's routes, added to the plugin's app under ``/ui/``.

- ``GET /ui/``: the page (its script polls ``data``), or the token form without a valid token.
- ``POST /ui/login``: the form's token (a form field, never a URL: a token in a query string ends up
  in access logs and browser history); when valid it is kept in an HttpOnly, SameSite=Strict cookie.
  A ``?token=`` in a URL is never read.
- ``POST /ui/logout``: forget the cookie.
- ``GET /ui/data``: the snapshot (``view_data.view_snapshot``) as JSON.
- ``POST /ui/action``: ``{"action": "retry"|"discard"|"requeue", "sink": ..., "group": ...}``
  (``actions.run_action``); JSON only, so a cross-site form cannot post one.

Every route but the token form and the static files needs the cookie's token to be a valid API
token (``sequin token create``), checked like the pull API's bearer tokens.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from sequin_provider.plugins import page

TOKEN_COOKIE = "sequin_token"
TOKEN_IN_URL = "API tokens are not accepted in URLs (they would end up in access logs): enter it here."
NO_TOKEN = "An API token (sequin token create NAME) is needed to see this page."
NO_STORE = {"Cache-Control": "no-store"}


def _html(body: str, status: int = 200) -> HTMLResponse:
    headers = {**NO_STORE, "Content-Security-Policy": page.CONTENT_SECURITY_POLICY, "X-Frame-Options": "SAMEORIGIN"}
    return HTMLResponse(body, status, headers=headers)


def _cookie_path(request: Request) -> str:
    """The view's path as the browser sees it (the plugin's mount point, then ``/ui``)."""
    return f"{request.scope.get('root_path', '').rstrip('/')}/ui"


def add_view_routes(app: FastAPI, config: Any, service: Any) -> None:
    """Add the view's routes to ``app`` (the plugin's stream API app); ``service`` checks tokens."""
    from sequin_provider.plugins.actions import ActionError, run_action
    from sequin_provider.plugins.view_data import view_snapshot

    async def token_problem(token: str | None) -> str | None:
        """Why ``token`` is not accepted, or None when it is."""
        if not token:
            return NO_TOKEN
        service.ensure_open()
        try:
            await run_in_threadpool(service.authorize, token)
        except Exception as exc:  # noqa: BLE001 - ApiError: unknown or revoked; the store unreachable
            return str(exc) or type(exc).__name__
        return None

    @app.get("/ui/", include_in_schema=False, response_class=HTMLResponse)
    async def view(request: Request) -> Response:
        notice = TOKEN_IN_URL if "token" in request.query_params else None
        problem = await token_problem(request.cookies.get(TOKEN_COOKIE))
        if problem:
            return _html(page.token_form(problem, notice), 200 if problem == NO_TOKEN else 401)
        return _html(page.asset("view.html").decode())

    @app.post("/ui/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = await request.form()
        token = str(form.get("token") or "").strip()
        problem = await token_problem(token)
        if problem:
            return _html(page.token_form(problem), 401)
        response = RedirectResponse("./", status_code=303, headers=NO_STORE)
        response.set_cookie(
            TOKEN_COOKIE,
            token,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path=_cookie_path(request),
        )
        return response

    @app.post("/ui/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        response = RedirectResponse("./", status_code=303, headers=NO_STORE)
        response.delete_cookie(TOKEN_COOKIE, path=_cookie_path(request), httponly=True, samesite="strict")
        return response

    @app.get("/ui/data", include_in_schema=False)
    async def data(request: Request) -> Response:
        problem = await token_problem(request.cookies.get(TOKEN_COOKIE))
        if problem:
            return JSONResponse({"detail": problem}, 401, headers=NO_STORE)
        return JSONResponse(await run_in_threadpool(view_snapshot, config), headers=NO_STORE)

    @app.post("/ui/action", include_in_schema=False)
    async def action(request: Request) -> Response:
        problem = await token_problem(request.cookies.get(TOKEN_COOKIE))
        if problem:
            return JSONResponse({"detail": problem}, 401, headers=NO_STORE)
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return JSONResponse({"detail": "send the action as application/json"}, 415, headers=NO_STORE)
        try:
            body = await request.json()
            name, sink, group = body["action"], body["sink"], body.get("group")
            if not isinstance(name, str) or not isinstance(sink, str) or not isinstance(group, (str, type(None))):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            detail = 'expected {"action": "retry"|"discard"|"requeue", "sink": "...", "group": "..." or null}'
            return JSONResponse({"detail": detail}, 400, headers=NO_STORE)
        try:
            result = await run_in_threadpool(run_action, config, name, sink, group)
        except ActionError as exc:
            return JSONResponse({"detail": str(exc)}, 400, headers=NO_STORE)
        except Exception as exc:  # noqa: BLE001 - the store or the sink unreachable: the page shows why
            return JSONResponse({"detail": f"{type(exc).__name__}: {exc}"}, 500, headers=NO_STORE)
        return JSONResponse(result.as_dict(), headers=NO_STORE)

    @app.get("/ui/{name}", include_in_schema=False)  # last: after the named routes
    async def static(name: str) -> Response:
        if name not in page.ASSETS or name.endswith(".html"):
            return JSONResponse({"detail": "not found"}, 404)
        return Response(page.asset(name), media_type=page.ASSETS[name], headers={"Cache-Control": "no-cache"})
