"""An OpenAI-compatible endpoint that records each model call of a session (issue 42; docs/gateway.md).

`gateway` holds the sessions agents reach (`Gateway.session`, the Python helper), their keys
and servers; `server` runs it (`serve`, on uvicorn in the caller's loop); `app` is the HTTP routes; `forward` is one call, forwarded and recorded through
the session's handle; `wire` is what vLLM's OpenAI server is asked for and answers; `upstream`
routes sessions to inference servers over one pooled client; `keys` derives per-session secrets;
`agent` runs an agent process and fails its session on a bad exit; `settings` and `refusals`
hold the configuration and the HTTP errors. Import from the modules themselves (starlette,
uvicorn and httpx, the `gateway` extra, load only there).
"""
