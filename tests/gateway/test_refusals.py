"""Hostile and sloppy requests get a clear JSON error and leave a truthful log: a wrong or
another session's key, hostile session ids and keys, an ended or unknown session, oversized and
malformed bodies, unknown paths."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessions.gateway.keys import SessionKeys
from tests.gateway.conftest import identity, stack
from tests.gateway.test_recording import CONVERSATION

CHAT = {"model": "m", "messages": CONVERSATION}


async def versions(gateway: Any, *session_ids: str) -> list[int]:
    return [(await gateway.ledger.load_session(sid)).version for sid in session_ids]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_a_wrong_key_is_refused_without_touching_the_log(url: str) -> None:
    async with stack(url) as (gateway, standin), httpx.AsyncClient() as http:
        async with gateway.session("a", **identity(uid="a")) as a:
            async with gateway.session("b", **identity(uid="b")) as b:
                before = await versions(gateway, "a", "b")
                foreign = SessionKeys(b"another gateway's key!!").key_for("a")
                tampered = a.api_key[:-1] + ("0" if a.api_key[-1] != "0" else "1")
                for key, path, status in [
                    (foreign, "/v1/chat/completions", 401),
                    (tampered, "/v1/chat/completions", 401),
                    ("sk-not-a-gateway-key", "/v1/chat/completions", 401),
                    (b.api_key, "/sessions/a/v1/chat/completions", 403),  # another session's
                    (gateway.keys.admin_key(), "/v1/chat/completions", 401),
                ]:
                    answer = await http.post(
                        gateway.base_url + path, json=CHAT, headers=bearer(key)
                    )
                    assert answer.status_code == status, (key, path, answer.text)
                    assert answer.json()["error"]["type"] in ("invalid_api_key", "wrong_session")
                no_key = await http.post(a.base_url + "/chat/completions", json=CHAT)
                assert no_key.status_code == 401
                assert await versions(gateway, "a", "b") == before
                assert standin.requests == []  # nothing was forwarded either


async def test_an_ended_or_unknown_session_is_refused_and_nothing_recorded(url: str) -> None:
    async with stack(url) as (gateway, standin), httpx.AsyncClient() as http:
        async with gateway.session("done", **identity()) as s:
            base_url, key = s.base_url, s.api_key
        before = await versions(gateway, "done")
        answer = await http.post(base_url + "/chat/completions", json=CHAT, headers=bearer(key))
        assert answer.status_code == 409 and answer.json()["error"]["type"] == "session_ended"
        assert await versions(gateway, "done") == before
        ghost = gateway.keys.key_for("never-created")
        answer = await http.post(
            gateway.base_url + "/v1/chat/completions", json=CHAT, headers=bearer(ghost)
        )
        assert answer.status_code == 404 and answer.json()["error"]["type"] == "unknown_session"
        assert standin.requests == []


async def test_sloppy_bodies_and_paths(url: str) -> None:
    async with (
        stack(url, max_body_bytes=4096) as (gateway, standin),
        httpx.AsyncClient() as http,
    ):
        async with gateway.session("s", **identity()) as s:
            chat = s.base_url + "/chat/completions"
            huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 10_000}]}
            before = await versions(gateway, "s")
            answer = await http.post(chat, json=huge, headers=bearer(s.api_key))
            assert answer.status_code == 413
            assert await versions(gateway, "s") == before  # nothing written
            nan = b'{"model": "m", "messages": [], "temperature": NaN}'
            answer = await http.post(chat, content=nan, headers=bearer(s.api_key))
            assert answer.status_code == 400 and "finite" in answer.json()["error"]["message"]
            assert await versions(gateway, "s") == before  # refused before its intent
            answer = await http.post(chat, content=b"{not json", headers=bearer(s.api_key))
            assert answer.status_code == 400 and "not JSON" in answer.json()["error"]["message"]
            assert s.handle.view.calls["c1"].failed  # the refused call is in the log, failed
            answer = await http.post(
                chat, json={**CHAT, "n": 3}, headers=bearer(s.api_key)
            )  # one answer per call
            assert answer.status_code == 400 and "n=3" in answer.json()["error"]["message"]
            answer = await http.post(s.base_url + "/embeddings", json={}, headers=bearer(s.api_key))
            assert answer.status_code == 404 and "error" in answer.json()
            answer = await http.get(chat, headers=bearer(s.api_key))
            assert answer.status_code == 405 and "error" in answer.json()
        assert standin.requests == []


_hostile_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=300
) | st.sampled_from(
    ["..", "../../etc/passwd", "%2e%2e", "a/b", "rlg_", "rlg_.", "rlg_YQ.", "\x00", "@run:x"]
)


async def test_hostile_session_ids_and_keys_are_refused_cleanly(url: str) -> None:
    async with stack(url) as (gateway, standin), httpx.AsyncClient() as http:
        async with gateway.session("victim", **identity()) as victim:
            before = await versions(gateway, "victim")
            seen: list[int] = []

            @settings(
                max_examples=60,
                deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
            )
            @given(session_id=_hostile_text, key=_hostile_text)
            def attack(session_id: str, key: str) -> None:
                seen.append(0)
                future = asyncio.run_coroutine_threadsafe(probe(session_id, key), loop)
                future.result(timeout=60)

            async def probe(session_id: str, key: str) -> None:
                from urllib.parse import quote

                for path, k in [
                    (f"/sessions/{quote(session_id, safe='')}/v1/chat/completions", key),
                    (f"/sessions/{quote(session_id, safe='')}/v1/chat/completions", victim.api_key),
                    ("/v1/chat/completions", key),
                ]:
                    target = httpx.URL(gateway.base_url + path)
                    if k == victim.api_key and (
                        session_id == "victim" or not target.path.startswith("/sessions/")
                    ):
                        continue  # the victim's own key on its own session (after the
                        # client's normalisation of `..`): a legitimate call, not an attack
                    headers = [(b"authorization", b"Bearer " + k.encode("utf-8", "replace"))]
                    try:
                        answer = await http.post(
                            gateway.base_url + path, json=CHAT, headers=headers
                        )
                    except httpx.LocalProtocolError:
                        continue  # a header the client itself will not send
                    if any(c < 32 and c != 9 or c == 127 for c in k.encode("utf-8", "replace")):
                        # a control character in a header: uvicorn's HTTP parser refuses the
                        # request before the gateway sees it
                        assert answer.status_code == 400, (path, answer.text)
                        continue
                    assert answer.status_code in (401, 403, 404), (path, answer.text)
                    assert answer.json()["error"]["message"]

            loop = asyncio.get_running_loop()
            await asyncio.to_thread(attack)
            assert seen
            assert await versions(gateway, "victim") == before
            assert standin.requests == []
