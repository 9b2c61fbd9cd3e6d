#!/usr/bin/env python3
"""Checks a running `tessera serve` with the official `openai` client (pip install openai).

Usage: check_serve_openai.py BASE_URL MODEL

Completions and chat, streamed and not (the streamed text must equal the whole answer), seeds
(the same seed gives the same text), stop strings, usage, and the errors the client raises for
an unknown model, a bad max_tokens, a prompt past the context and an unsupported key. Prints
"OK: <n> checks" and exits 0 when all pass; the first failure raises.
"""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=120)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


ids = [m.id for m in client.models.list().data]
check(ids == [model], f"models.list: {ids}")
check(client.models.retrieve(model).id == model, "models.retrieve")

greedy = dict(model=model, prompt="It is a truth", max_tokens=8, temperature=0)
c = client.completions.create(**greedy)
text = c.choices[0].text
check(isinstance(text, str) and c.object == "text_completion", f"completion: {c}")
check(c.usage.completion_tokens <= 8 and c.usage.prompt_tokens > 0, f"usage: {c.usage}")
check(c.choices[0].finish_reason in ("length", "stop"), f"finish_reason: {c.choices[0].finish_reason}")
check(client.completions.create(**greedy).choices[0].text == text, "greedy is deterministic")

streamed = list(client.completions.create(**greedy, stream=True, stream_options={"include_usage": True}))
check("".join(ch.choices[0].text for ch in streamed if ch.choices) == text, f"streamed text != whole text {text!r}")
check(streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == c.usage.completion_tokens, "stream usage")
check([ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == c.choices[0].finish_reason, "stream finish_reason")

sampled = dict(model=model, prompt="It is", max_tokens=12, temperature=1.0, top_p=0.95, seed=7)
a = client.completions.create(**sampled).choices[0].text
b = client.completions.create(**sampled).choices[0].text
check(a == b, f"seed 7 twice: {a!r} vs {b!r}")

# A stop string taken from the greedy text ends the text before it.
long = client.completions.create(model=model, prompt="It is a truth", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
t = long.choices[0].text
stop = t[len(t) // 2:len(t) // 2 + 2]
if stop.strip():
    s = client.completions.create(model=model, prompt="It is a truth", max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    check(s.choices[0].text == t[:t.index(stop)] and s.choices[0].finish_reason == "stop", f"stop {stop!r}: {s.choices[0].text!r} of {t!r}")

messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "It is a truth"}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
m = chat.choices[0].message
check(m.role == "assistant" and isinstance(m.content, str) and chat.object == "chat.completion", f"chat: {chat}")
chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True))
check(chunks[0].choices[0].delta.role == "assistant", "first chat chunk has the role")
check("".join(ch.choices[0].delta.content or "" for ch in chunks) == m.content, "streamed chat == whole chat")
check(chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason, "chat stream finish_reason")


def fails(exc, status, fragment, **kw):
    try:
        client.completions.create(**{"model": model, "prompt": "x", **kw})
    except exc as e:
        check(e.status_code == status and fragment in str(e), f"{kw}: {e}")
        return
    raise AssertionError(f"{kw} was accepted")


fails(openai.NotFoundError, 404, "does not exist", model="no-such-model")
fails(openai.BadRequestError, 400, "max_tokens", max_tokens=-1)
fails(openai.BadRequestError, 400, "max_tokens", max_tokens=10**12)
fails(openai.BadRequestError, 400, "maximum context length", prompt="word " * 5000, max_tokens=1)
fails(openai.BadRequestError, 400, "`n`", n=2)
print(f"OK: {checks} checks")
