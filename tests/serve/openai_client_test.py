#!/usr/bin/env python3
"""The official `openai` Python client against `areno serve` (issue 7, must show 4).

Starts `areno serve` (the embedded demo model unless --model-path is given) on a
free loopback port, drives text, streaming, n > 1, legacy completions and
errors through the client, an image (data URL), an audio clip (input_audio)
and both in one message through the demo model's towers, then sends SIGTERM
during a stream and checks that the stream completes and the server exits 0.

    pip install openai
    python3 tests/serve/openai_client_test.py --areno build/app/areno
    # or, when meson found the package: meson test -C build --suite openai-client
"""
import argparse
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"areno serve exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("areno serve did not become healthy")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--areno", default="build/app/areno")
    ap.add_argument("--model-path", default="")
    args = ap.parse_args()

    import openai

    port = free_port()
    cmd = [args.areno, "serve", "--port", str(port), "--api-key", "k"]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    proc = subprocess.Popen(cmd)
    signalled = False
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        client = openai.OpenAI(base_url=base + "/v1", api_key="k")
        model = client.models.list().data[0].id
        assert client.models.retrieve(model).id == model
        print("model:", model)

        msgs = [{"role": "user", "content": "Hello, who are you?"}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        assert r.object == "chat.completion"
        assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        greedy = r.choices[0].message.content
        r0_prompt_tokens = r.usage.prompt_tokens
        print("text ok:", repr(greedy))

        stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        assert text == greedy, (text, greedy)
        assert finish in ("stop", "length") and usage is not None
        print("streaming ok")

        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, n=3, seed=3, temperature=1.0,
                                           logprobs=True, top_logprobs=2)
        assert [c.index for c in r.choices] == [0, 1, 2]
        for c in r.choices:
            assert c.logprobs is not None and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        print("n>1 ok")

        # Media through the towers: a PPM image as a data URL, a WAV clip as input_audio.
        w, h = 64, 40
        ppm = b"P6 %d %d 255\n" % (w, h) + bytes((i * 37) % 256 for i in range(w * h * 3))
        image = {"type": "image_url",
                 "image_url": {"url": "data:image/x-portable-pixmap;base64," + base64.b64encode(ppm).decode()}}
        wav_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "audio", "speech_16k_mono.wav")
        with open(wav_path, "rb") as f:
            audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(f.read()).decode(), "format": "wav"}}
        text_only = client.chat.completions.create(model=model, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Describe it."}]}])
        sizes = {}
        for name, parts in (("image", [image]), ("audio", [audio]), ("image+audio", [image, audio])):
            r = client.chat.completions.create(model=model, max_tokens=4, temperature=1.0, seed=1, messages=[
                {"role": "user", "content": parts + [{"type": "text", "text": "Describe it."}]}])
            assert r.choices[0].finish_reason in ("stop", "length"), r
            sizes[name] = r.usage.prompt_tokens - text_only.usage.prompt_tokens
        # The media tokens add up: image+audio = image + audio placeholders.
        assert sizes["image"] > 273 and sizes["audio"] > 10, sizes
        assert sizes["image+audio"] == sizes["image"] + sizes["audio"], sizes
        print("image, audio, image+audio ok", sizes)

        # Speech to text through the client's audio API (multipart/form-data):
        # the text equals the chat turn it amounts to; the stream's typed
        # events add up to it; verbose_json parses into its type.
        with open(wav_path, "rb") as f:
            wav = f.read()
        asr = client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [audio, {"type": "text", "text": "<|audio_1|>Transcribe the audio clip into text."}]}])
        t = client.audio.transcriptions.create(model=model, file=("clip.wav", wav), language="en",
                                               extra_body={"max_completion_tokens": 8})
        assert t.text == asr.choices[0].message.content and t.usage.output_tokens == asr.usage.completion_tokens, (t, asr)
        v = client.audio.transcriptions.create(model=model, file=("clip.wav", wav), response_format="verbose_json",
                                               timestamp_granularities=["segment"], extra_body={"max_completion_tokens": 8})
        assert v.text == t.text and abs(v.duration - 1.898625) < 1e-6 and v.segments[0].end == v.duration, v
        deltas, done = "", None
        for ev in client.audio.transcriptions.create(model=model, file=("clip.wav", wav), stream=True,
                                                     extra_body={"max_completion_tokens": 8}):
            if ev.type == "transcript.text.delta":
                deltas += ev.delta
            elif ev.type == "transcript.text.done":
                done = ev.text
        assert deltas == t.text and done == t.text, (deltas, done, t.text)
        try:
            client.audio.transcriptions.create(model=model, file=("clip.wav", wav), language="xx")
            raise AssertionError("language xx accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "language", e.body
        print("audio transcriptions ok", repr(t.text))

        # The Responses API: the client's typed Response and events; the text
        # is the chat answer to the same turn; image parts; a required call
        # comes back as a function_call item; vLLM's token fields through extra_body.
        resp = client.responses.create(model=model, input=msgs[0]["content"], max_output_tokens=8, temperature=0)
        assert resp.status == "completed" and resp.output_text == greedy, (resp, greedy)
        assert resp.usage.input_tokens == r0_prompt_tokens and resp.usage.input_tokens_details.cached_tokens >= 0
        kinds, deltas, final = [], "", None
        for ev in client.responses.create(model=model, input=msgs[0]["content"], max_output_tokens=8, temperature=0,
                                          stream=True):
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
            if ev.type == "response.completed":
                final = ev.response
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
        assert deltas == greedy and final.output_text == greedy, (deltas, final)
        ri = client.responses.create(model=model, max_output_tokens=4, temperature=1.0, extra_body={"seed": 1}, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": image["image_url"]["url"]},
                                         {"type": "input_text", "text": "Describe it."}]}])
        assert ri.usage.input_tokens - text_only.usage.prompt_tokens == sizes["image"], (ri.usage, sizes)
        rt = client.responses.create(model=model, input="Add 2 and 3.", tool_choice="required", max_output_tokens=60,
                                     temperature=0, tools=[{"type": "function", "name": "add", "parameters": {
                                         "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                         "required": ["a", "b"]}}])
        calls = [o for o in rt.output if o.type == "function_call"]
        assert calls and calls[0].name == "add" and set(json.loads(calls[0].arguments)) == {"a", "b"}, rt.output
        # Stored responses: previous_response_id continues one, retrieve,
        # input_items.list and delete as the client calls them.
        follow = client.responses.create(model=model, previous_response_id=resp.id, input="And again?",
                                         max_output_tokens=4, temperature=0)
        assert follow.previous_response_id == resp.id and follow.usage.input_tokens > resp.usage.input_tokens, follow
        assert client.responses.retrieve(resp.id).output_text == greedy
        counted = client.responses.input_tokens.count(model=model, previous_response_id=resp.id, input="And again?")
        assert counted.object == "response.input_tokens" and counted.input_tokens == follow.usage.input_tokens, counted
        listed = [item.content for item in client.responses.input_items.list(follow.id, order="asc")]
        assert len(listed) == 3 and listed[0][0].text == msgs[0]["content"] and listed[2][0].text == "And again?", listed
        bg = client.responses.create(model=model, input=msgs[0]["content"], max_output_tokens=8, temperature=0,
                                     background=True)
        assert bg.status == "queued" and bg.background, bg
        for _ in range(600):
            bg = client.responses.retrieve(bg.id)
            if bg.status not in ("queued", "in_progress"):
                break
            time.sleep(0.05)
        assert bg.status == "completed" and bg.output_text == greedy, bg
        # A background stream: the client stops reading after two events and
        # resumes from the last sequence number it saw, as the SDK does it.
        with client.responses.stream(model=model, input=msgs[0]["content"], max_output_tokens=8, temperature=0,
                                     background=True) as first:
            head = []
            for event in first:
                head.append(event)
                if len(head) == 2:
                    break
        assert head[0].type == "response.created" and head[0].response.status == "queued", head
        with client.responses.stream(response_id=head[0].response.id,
                                     starting_after=head[-1].sequence_number) as rest:
            tail = list(rest)
            resumed = rest.get_final_response()
        assert [e.sequence_number for e in head + tail] == list(range(len(head) + len(tail))), head + tail
        assert resumed.status == "completed" and resumed.output_text == greedy, resumed
        # A conversation: its items are the history; a response in it adds its turn.
        conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": msgs[0]["content"]}],
                                           metadata={"run": "client"})
        assert conv.id.startswith("conv_") and conv.metadata == {"run": "client"}, conv
        in_conv = client.responses.create(model=model, conversation=conv.id, input="And again?",
                                          max_output_tokens=4, temperature=0)
        plain = client.responses.create(model=model, input=[{"role": "user", "content": msgs[0]["content"]},
                                                            {"role": "user", "content": "And again?"}],
                                        max_output_tokens=4, temperature=0, store=False)
        assert in_conv.conversation.id == conv.id and in_conv.usage.input_tokens == plain.usage.input_tokens, in_conv
        assert in_conv.output_text == plain.output_text, (in_conv, plain)
        conv_items = list(client.conversations.items.list(conv.id, order="asc"))
        assert [i.type for i in conv_items] == ["message"] * 3 and conv_items[2].id == in_conv.output[0].id, conv_items
        assert conv_items[0].content[0].text == msgs[0]["content"], conv_items
        added = client.conversations.items.create(conv.id, items=[{"role": "user", "content": "More."}])
        assert len(added.data) == 1 and client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id == added.data[0].id
        assert client.conversations.update(conv.id, metadata={"run": "done"}).metadata == {"run": "done"}
        assert client.conversations.delete(conv.id).deleted
        long_bg = client.responses.create(model=model, input="Tell me a story.", max_output_tokens=3000,
                                          background=True, extra_body={"ignore_eos": True})
        assert client.responses.cancel(long_bg.id).status == "cancelled"
        client.responses.delete(resp.id)
        try:
            client.responses.retrieve(resp.id)
            raise AssertionError("a deleted response retrieved")
        except openai.NotFoundError:
            pass
        try:
            client.responses.create(model=model, input="hi", previous_response_id=resp.id)
            raise AssertionError("a deleted previous_response_id accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "previous_response_id", e.body
        ids = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0,
                                             extra_body={"return_token_ids": True, "prompt_logprobs": 1})
        extra = ids.model_extra
        assert len(extra["prompt_token_ids"]) == r0_prompt_tokens and len(extra["prompt_logprobs"]) == r0_prompt_tokens
        assert extra["prompt_logprobs"][0] is None and len(ids.choices[0].model_extra["token_ids"]) == ids.usage.completion_tokens
        print("responses ok", repr(resp.output_text))

        # Forced tool calls (constrained decoding): the demo model never calls a
        # tool by itself; "required" and a named function make it, streamed or not,
        # and json_object makes the content one JSON object.
        tools = [{"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
                 {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        ask = [{"role": "user", "content": "What is 2 + 3?"}]
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            r = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice=choice,
                                               max_tokens=64, temperature=0)
            call = r.choices[0].message.tool_calls[0]
            assert r.choices[0].finish_reason == "tool_calls", r
            assert call.function.name in ("add", "get_weather"), call
            assert isinstance(json.loads(call.function.arguments), dict), call
            parts, finish = {}, None
            for chunk in client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice=choice,
                                                        max_tokens=64, temperature=0, stream=True):
                for ch in chunk.choices:
                    assert not ch.delta.content, ch  # the call never arrives as text
                    for t in ch.delta.tool_calls or []:
                        p = parts.setdefault(t.index, {"name": "", "arguments": ""})
                        p["name"] += t.function.name or ""
                        p["arguments"] += t.function.arguments or ""
                    finish = ch.finish_reason or finish
            assert finish == "tool_calls" and parts == {0: {"name": call.function.name,
                                                            "arguments": call.function.arguments}}, (parts, call)
        r = client.chat.completions.create(model=model, messages=ask, response_format={"type": "json_object"},
                                           max_tokens=32, temperature=1.0, seed=4)
        assert isinstance(json.loads(r.choices[0].message.content), dict), r
        print("forced tool calls and json_object ok")

        # Structured output as the client library does it: a Pydantic model
        # becomes a strict json_schema (enum, list, Optional as anyOf with
        # null, every field required, no additional properties), and the
        # reply parses back into the model. Forced calls follow the tool's
        # parameters: `add` takes integers a and b, in that order.
        from typing import Literal, Optional
        from pydantic import BaseModel

        class Answer(BaseModel):
            verdict: Literal["yes", "no"]
            numbers: list[int]
            note: Optional[str]

        parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
        for temperature in (0.0, 1.0):
            r = parse(model=model, messages=ask, response_format=Answer, max_tokens=96, temperature=temperature, seed=2)
            assert r.choices[0].finish_reason == "stop", r
            assert isinstance(r.choices[0].message.parsed, Answer), r
            assert list(json.loads(r.choices[0].message.content)) == ["verdict", "numbers", "note"], r
        # Pydantic's `pattern`, the `format` of date, datetime and UUID fields, integer and number ranges, a tuple.
        import datetime, uuid
        from pydantic import Field

        class Ticket(BaseModel):
            code: str = Field(pattern=r"^[A-Z]{2}-\d{3}$")
            day: datetime.date
            at: datetime.datetime
            id: uuid.UUID
            priority: int = Field(ge=1, le=5)
            seen: int = Field(ge=0)
            year: int = Field(gt=1900)
            share: float = Field(ge=0, le=1)
            delta: float = Field(gt=-0.5, lt=0.25)
            pair: tuple[int, str]

        r = parse(model=model, messages=ask, response_format=Ticket, max_tokens=160, temperature=1.0, seed=4)
        assert r.choices[0].finish_reason == "stop", r
        t = r.choices[0].message.parsed
        assert isinstance(t, Ticket) and re.fullmatch(r"[A-Z]{2}-\d{3}", t.code) and 1 <= t.priority <= 5 and t.seen >= 0, r
        assert t.year > 1900 and 0 <= t.share <= 1 and -0.5 < t.delta < 0.25, r
        assert isinstance(t.pair[0], int) and isinstance(t.pair[1], str), r
        r = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=64, temperature=1.0,
                                           seed=3, tool_choice={"type": "function", "function": {"name": "add"}})
        args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        assert set(args) <= {"a", "b"} and all(isinstance(v, int) for v in args.values()), args
        assert list(args) == sorted(args), args  # a before b: the schema's order
        # vLLM's own fields through the client's extra_body, as vLLM users send them.
        c = client.completions.create(model=model, prompt="The answer is", max_tokens=16, temperature=1.0, seed=5,
                                      extra_body={"guided_choice": ["positive", "negative"]})
        assert c.choices[0].text in ("positive", "negative"), c
        r = client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=1.0, seed=6,
                                           extra_body={"guided_json": Answer.model_json_schema()})
        Answer.model_validate_json(r.choices[0].message.content)
        c = client.completions.create(model=model, prompt="Call", max_tokens=30, temperature=1.0, seed=7,
                                      extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.choices[0].text), c
        try:
            client.chat.completions.create(model=model, messages=ask, max_tokens=4, extra_body={"guided_regex": "(?=a)b"})
            raise AssertionError("a lookahead in guided_regex was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "guided_regex", e.body
        c = client.completions.create(model=model, prompt="List", max_tokens=30, temperature=1.0, seed=8,
                                      extra_body={"guided_grammar": 'root ::= "(" word ("," word){0,2} ")"\nword ::= [a-z]+'})
        assert re.fullmatch(r"\([a-z]+(,[a-z]+){0,2}\)", c.choices[0].text), c
        try:
            client.chat.completions.create(model=model, messages=ask, max_tokens=4, extra_body={"guided_grammar": "root ::= x"})
            raise AssertionError("a grammar with an undefined rule was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "guided_grammar" and "never defined" in e.body["message"], e.body
        print("json_schema (Pydantic, patterns and formats too), tool parameters and vLLM's guided fields ok")

        c = client.completions.create(model=model, prompt=[24912, 2375, 13], echo=True, logprobs=1, max_tokens=0)
        assert c.choices[0].logprobs.token_logprobs[0] is None
        assert len(c.choices[0].logprobs.token_logprobs) == 3
        print("completions echo ok")

        try:
            client.chat.completions.create(model="no-such-model", messages=msgs)
            raise AssertionError("expected 404")
        except openai.NotFoundError as e:
            assert e.status_code == 404
        try:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]}])
            raise AssertionError("expected 400")
        except openai.BadRequestError as e:
            assert e.status_code == 400
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong")
        try:
            bad.models.list()
            raise AssertionError("expected 401")
        except openai.AuthenticationError:
            pass
        print("errors ok")

        # SIGTERM while a stream is running: the stream still completes, then
        # the server exits 0.
        stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=48, temperature=1.0,
                                                stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        first = next(it)
        assert first.choices[0].delta.role == "assistant"
        proc.send_signal(signal.SIGTERM)
        signalled = True
        finish = None
        for chunk in it:
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
        assert finish == "length", finish
        print("drain on SIGTERM ok")
    finally:
        if not signalled:  # a second signal kills without draining
            proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, f"areno serve exited with {rc}"
    print("openai client test passed")


if __name__ == "__main__":
    sys.exit(main())
