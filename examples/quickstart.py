"""Generate a few chat completions with the embedded default model and print them with tokens/s."""

import time

import strand
from strand.runtime.tokenizer import apply_chat_template

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def main():
    engine = strand.Engine()
    prompts = [apply_chat_template(engine.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    t0 = time.perf_counter()
    outs = engine.generate(prompt=prompts, sampling_params={"temperature": 0, "max_new_tokens": 64})
    dt = time.perf_counter() - t0
    for q, o in zip(QUESTIONS, outs):
        print(f"Q: {q}\nA: {o['text']}\n")
    n = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(f"{n} tokens in {dt:.2f}s: {n / dt:.1f} output tokens/s (batch of {len(prompts)})")
    engine.shutdown()


if __name__ == "__main__":
    main()
