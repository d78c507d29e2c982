"""transformers' own OpenAI-compatible server hosts the folder `lex export` writes, as a user runs it:
`transformers serve OUT_DIR --trust-remote-code`, then a chat completion through the `openai` client."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from configuration_lex import LexConfig
from lex.cli import main as lex
from lex.data import kjv_books, train_tokenizer
from modeling_lex import LexForCausalLM

for extra in ("fastapi", "uvicorn", "openai"):  # the `serve` extra
    pytest.importorskip(extra)

pytestmark = [pytest.mark.slow, pytest.mark.oldest]

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "In the beginning God created the heaven and the earth."}]
NEW_TOKENS = 12


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float = 240.0) -> None:
    """Poll /health until it answers 200; fail with the server's log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"transformers serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"transformers serve did not answer /health in {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def test_transformers_serve_answers_a_chat_completion_for_an_exported_folder(tmp_path):
    """A sliding window of 16 with 2 sinks, a prompt and answer past it: the served greedy answer is the text that
    the model's own generate() gives (the remote code reads as LEX reads, window and sinks included)."""
    from openai import OpenAI

    tokenizer = train_tokenizer([b["text"][:20_000] for b in kjv_books()[:2]], vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    # (transformers serve 5.25 caps prompt and answer at max_position_embeddings, LEX's training length)
    config = LexConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=64, attention_mode="sliding",
                       attention_window=16, attention_sinks=2, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    model = LexForCausalLM(config).eval()
    with torch.no_grad():  # clear-cut greedy choices
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    folder = tmp_path / "exported"
    assert lex(["export", str(tmp_path / "model"), str(folder)]) == 0

    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    assert ids.shape[1] + NEW_TOKENS > config.attention_window + config.attention_sinks
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:]
    expected_text = tokenizer.decode(expected, skip_special_tokens=True)

    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    command = [str(Path(sys.executable).parent / "transformers"), "serve", str(folder), "--trust-remote-code",
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as output:
        server = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # its own group: the model process it spawns goes too
    try:
        wait_until_healthy(server, port, log)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(model=str(folder), messages=MESSAGES,
                                                               max_tokens=NEW_TOKENS, temperature=0)
        assert raw.status_code == 200
        answer = raw.parse()
        text = answer.choices[0].message.content
        assert text and text == expected_text, (text, expected_text, log.read_text()[-4000:])
        assert answer.usage.prompt_tokens == ids.shape[1]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
