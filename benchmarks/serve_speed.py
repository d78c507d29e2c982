"""`lex serve` under load, side by side in one run: the same server at concurrency 1 and at concurrency N, a long
prompt read while short requests decode, and a second question about a read document from a kept state.

Each phase starts `lex serve` as a user does (a subprocess, SmolLM2-135M from the GGUF by default, sliding 1,024 +
4 sinks + a memory of 64 blocks, --threads) and talks to it over HTTP with the `openai` client, streaming, so every
token is time-stamped where the client sees it.

1. Concurrency: N clients x --new tokens on prompts of 1-2k tokens (King James Bible text), first one after the
   other, then all at once. Decoding tokens/s is the engine's (tokens its decoding steps made / the seconds they
   took, GET /health), so prompt reading is not counted at either concurrency; the client-side figure beside it
   is every new token over the time at least one client was between its first and last token. Request latency
   p50/p95 and time to first token are printed for both.
2. A long prompt (--long_tokens) sent while --short requests decode: the short requests' inter-token latency
   while it is read (the engine reads prompt forwards up to w tokens, then runs one decoding step of every
   decoding request, in turn).
3. Kept states: a conversation whose system message holds a --document_tokens document, asked one question by a
   server with --state_cache_bytes and --state_dir, then another: the second's time to first token beside the
   first's; the same after a restart on the same --state_dir; each answer beside a fresh server's (no states).
"""

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, real_checkpoint, write_output

import httpx  # noqa: E402  (the serve extra)
from openai import OpenAI  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`lex serve MODEL ...` in a subprocess, up once /health answers."""

    def __init__(self, args, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = str(args.model)
        command = [sys.executable, "-m", "lex.cli", "serve", self.name, "--port", str(self.port),
                   "--threads", str(args.threads), "--attention_mode", "sliding", "--attention_window", "1024",
                   "--attention_sinks", "4", "--attention_memory_blocks", str(args.memory_blocks),
                   "--max_new_tokens_limit", "1024", "--max_prompt_tokens", str(args.long_tokens + 4096), *flags]
        self.log = open(Path(tempfile.gettempdir()) / f"lex-serve-{self.port}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=self.log, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"lex serve exited: see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=3600)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(600)
        self.log.close()


def stream(server: Server, sent: list[float] | None = None, **request) -> dict:
    """One streamed request; when it was sent, its tokens' arrival times, its text and usage."""
    began = time.perf_counter()
    if sent is not None:
        sent.append(began)
    stamps, text, usage = [], [], None
    create = server.client.chat.completions.create if "messages" in request else server.client.completions.create
    for chunk in create(model=server.name, stream=True, stream_options={"include_usage": True}, temperature=0,
                        **request):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            piece = chunk.choices[0].delta.content if "messages" in request else chunk.choices[0].text
            if piece:
                stamps.append(time.perf_counter())
                text.append(piece)
    return {"sent": began, "stamps": stamps, "text": "".join(text), "usage": usage}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def texts(tokenizer, lengths: list[int]) -> list[str]:
    """Bible text of about each length in tokens, from different places."""
    from lex.data import kjv_books

    words = " ".join(book["text"] for book in kjv_books()).split()
    out, at = [], 0
    for length in lengths:
        piece = " ".join(words[at : at + length])
        ids = tokenizer(piece).input_ids[:length]
        out.append(tokenizer.decode(ids))
        at += length * 2
    return out


def concurrency(args, tokenizer) -> dict:
    lengths = [1024 + (1024 * i) // max(1, args.clients - 1) for i in range(args.clients)]
    prompts = texts(tokenizer, lengths)
    server = Server(args)
    rows = {}
    try:
        for label, together in (("concurrency 1", False), (f"concurrency {args.clients}", True)):
            before = server.health()
            results: list[dict] = [None] * len(prompts)

            def one(index: int) -> None:
                results[index] = stream(server, prompt=prompts[index], max_tokens=args.new)

            began = time.perf_counter()
            if together:
                threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            else:
                for index in range(len(prompts)):
                    one(index)
            wall = time.perf_counter() - began
            after = server.health()
            tokens = after["decoded_tokens"] - before["decoded_tokens"]
            seconds = after["decoding_seconds"] - before["decoding_seconds"]
            steps = after["decoding_steps"] - before["decoding_steps"]
            spans = sorted((r["stamps"][0], r["stamps"][-1]) for r in results)
            covered, end = 0.0, float("-inf")
            for first, last in spans:  # the union of the clients' decoding intervals
                covered += max(0.0, last - max(first, end))
                end = max(end, last)
            new = sum(r["usage"].completion_tokens for r in results)
            latency = [r["stamps"][-1] - r["sent"] for r in results]
            first_token = [r["stamps"][0] - r["sent"] for r in results]
            rows[label] = {
                "engine decoding tokens/s": tokens / seconds, "client decoding tokens/s": new / covered,
                "largest batch": after["largest_batch"], "mean batch": tokens / steps,
                "seconds a step": seconds / steps, "new tokens": new, "wall s": wall,
                "latency p50 s": percentile(latency, 0.5), "latency p95 s": percentile(latency, 0.95),
                "first token p50 s": percentile(first_token, 0.5),
                "prompt tokens": [r["usage"].prompt_tokens for r in results],
                "texts": [r["text"] for r in results],
            }
    finally:
        server.stop()
    one, many = rows["concurrency 1"], rows[f"concurrency {args.clients}"]
    same = sum(a == b for a, b in zip(one["texts"], many["texts"]))
    print(f"\n{args.clients} clients x {args.new} new tokens, prompts of {min(lengths)}-{max(lengths)} tokens")
    print("| | engine decoding tokens/s | client decoding tokens/s | latency p50 | latency p95 | first token p50 |")
    print("|---|---|---|---|---|---|")
    for label, row in rows.items():
        print(f"| {label} | {row['engine decoding tokens/s']:.1f} | {row['client decoding tokens/s']:.1f} | "
              f"{row['latency p50 s']:.1f} s | {row['latency p95 s']:.1f} s | {row['first token p50 s']:.1f} s |")
    engine = many["engine decoding tokens/s"] / one["engine decoding tokens/s"]
    client = many["client decoding tokens/s"] / one["client decoding tokens/s"]
    print(f"ratio (concurrency {args.clients} / 1): engine {engine:.2f}x, client {client:.2f}x; largest batch "
          f"{many['largest batch']}, mean {many['mean batch']:.2f}; a step {one['seconds a step'] * 1000:.0f} ms at "
          f"concurrency 1, {many['seconds a step'] * 1000:.0f} ms at {args.clients}; {same} of {len(prompts)} "
          "answers the same at both")
    for row in rows.values():
        row.pop("texts")
    return {"concurrency": rows, "same answers": same}


def long_read(args, tokenizer) -> dict:
    *short, long = texts(tokenizer, [100] * args.short + [args.long_tokens])
    server = Server(args)
    try:
        results: list[dict] = [None] * args.short
        sent: list[float] = []
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, stream(server, prompt=short[i], max_tokens=args.short_new))) for i in range(args.short)]
        for thread in threads:
            thread.start()
        time.sleep(3)  # the short ones read and decoding
        reply = stream(server, sent, prompt=long, max_tokens=8)
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    start, first = sent[0], reply["stamps"][0]
    gaps = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:]) if a >= start and b <= first]
    during = sum(1 for r in results for t in r["stamps"] if start <= t <= first)
    figures = {"long prompt tokens": reply["usage"].prompt_tokens, "long first token s": first - start,
               "short tokens during the read": during,
               "inter-token p50 s": percentile(gaps, 0.5) if gaps else None,
               "inter-token p95 s": percentile(gaps, 0.95) if gaps else None, "inter-token max s": max(gaps or [0])}
    print(f"\na {figures['long prompt tokens']}-token prompt read in {figures['long first token s']:.1f} s while "
          f"{args.short} short requests decode: they made {during} tokens meanwhile, inter-token latency p50 "
          f"{figures['inter-token p50 s']:.2f} s, p95 {figures['inter-token p95 s']:.2f} s, max "
          f"{figures['inter-token max s']:.2f} s (prompt forwards up to w tokens, then one decoding step, in turn)")
    return {"long read": figures}


def kept_states(args, tokenizer) -> dict:
    document = texts(tokenizer, [args.document_tokens])[0]
    questions = ["Who is named in the first verse of this text?", "Summarize the last sentence in five words.",
                 "What is one place mentioned above?"]

    def ask(server: Server, question: str) -> dict:
        return stream(server, messages=[{"role": "system", "content": document},
                                        {"role": "user", "content": question}], max_tokens=32)

    folder = Path(tempfile.mkdtemp(prefix="lex-states-"))
    flags = ("--state_cache_bytes", str(args.state_cache_bytes), "--state_dir", str(folder))
    server = Server(args, *flags)
    try:
        first, second = ask(server, questions[0]), ask(server, questions[1])
    finally:
        server.stop()
    server = Server(args, *flags)  # a restart on the same --state_dir
    try:
        restarted = ask(server, questions[2])
    finally:
        server.stop()
    fresh = Server(args)
    try:
        fresh_answers = [ask(fresh, q)["text"] for q in questions[1:]]
    finally:
        fresh.stop()
    ttft = [r["stamps"][0] - r["sent"] for r in (first, second, restarted)]
    figures = {"document tokens": first["usage"].prompt_tokens, "first question first token s": ttft[0],
               "second question first token s": ttft[1], "after a restart first token s": ttft[2],
               "second / first": ttft[1] / ttft[0], "restart / first": ttft[2] / ttft[0],
               "cached tokens": [r["usage"].prompt_tokens_details.cached_tokens for r in (first, second, restarted)],
               "equal to a fresh server": [second["text"] == fresh_answers[0], restarted["text"] == fresh_answers[1]],
               "state dir bytes": sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())}
    print(f"\na {figures['document tokens']}-token conversation: first question's first token "
          f"{ttft[0]:.1f} s; a second question from the kept state {ttft[1]:.2f} s ({figures['second / first']:.1%}); "
          f"after a restart on the same --state_dir {ttft[2]:.2f} s ({figures['restart / first']:.1%}); cached "
          f"tokens {figures['cached tokens']}; equal to a fresh server's answers: {figures['equal to a fresh server']}")
    return {"kept states": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a model folder or .gguf file (default: SmolLM2's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory_blocks", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--short_new", type=int, default=200)
    parser.add_argument("--long_tokens", type=int, default=32768)
    parser.add_argument("--document_tokens", type=int, default=12288)
    parser.add_argument("--state_cache_bytes", type=int, default=8 << 30)
    parser.add_argument("--phases", default="concurrency,long,states")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    args.model = real_checkpoint(args.model)
    from lex.models import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    print(f"lex serve {args.model.name}: sliding 1,024 + 4 sinks + memory {args.memory_blocks}, {args.threads} "
          f"threads, on {os.cpu_count()} CPUs")
    results = {}
    phases = {"concurrency": concurrency, "long": long_read, "states": kept_states}
    for name in args.phases.split(","):
        results |= phases[name](args, tokenizer)
    write_output(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
