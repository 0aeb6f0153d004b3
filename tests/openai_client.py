"""The openai Python package against a launched pdkv router (tests/front_door.rs runs this).

Usage: python tests/openai_client.py http://127.0.0.1:PORT/v1
"""

import sys

import openai

MODEL = "pdkv-reference"


def main(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    assert [model.id for model in client.models.list()] == [MODEL]

    whole = client.completions.create(model=MODEL, prompt="Hello, pdkv", max_tokens=12)
    assert whole.choices[0].finish_reason == "length", whole
    assert whole.usage.completion_tokens == 12, whole

    # The everyday streaming loop: every chunk has choices[0].
    streamed = ""
    for chunk in client.completions.create(model=MODEL, prompt="Hello, pdkv", max_tokens=12, stream=True):
        streamed += chunk.choices[0].text
    assert streamed == whole.choices[0].text, (streamed, whole.choices[0].text)

    # Usage only when asked for, after the last choice.
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="usage",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3, chunks[-1]
    assert all(chunk.choices for chunk in chunks[:-1])

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant", chat
    content = ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
    ):
        content += chunk.choices[0].delta.content or ""
    assert content == chat.choices[0].message.content, (content, chat)

    # Seeded sampling: the same answer twice; another seed, another answer.
    def sampled(seed):
        return client.completions.create(
            model=MODEL, prompt="seed", max_tokens=12, temperature=1.2, top_p=0.95, seed=seed
        ).choices[0].text

    assert sampled(5) == sampled(5)
    assert len({sampled(seed) for seed in range(4)}) > 1

    # A stop string the greedy answer holds: the answer ends before it, finish_reason "stop".
    greedy = client.completions.create(model=MODEL, prompt="stop here", max_tokens=32).choices[0].text
    ascii_chars = [c for c in greedy[1:] if c.isascii() and c.isprintable()]
    if ascii_chars:
        stop = ascii_chars[0]
        stopped = client.completions.create(model=MODEL, prompt="stop here", max_tokens=32, stop=[stop]).choices[0]
        assert stopped.finish_reason == "stop", stopped
        assert stopped.text == greedy[: greedy.index(stop)], (stopped.text, greedy, stop)

    # logprobs: the top 2 of each token, the chosen one among them (greedy).
    answer = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2).choices[0]
    assert len(answer.logprobs.token_logprobs) == 4, answer.logprobs
    assert all(len(top) >= 2 for top in answer.logprobs.top_logprobs), answer.logprobs
    chat_logprobs = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=2
    ).choices[0].logprobs
    assert len(chat_logprobs.content) == 3 and len(chat_logprobs.content[0].top_logprobs) == 2, chat_logprobs

    # Refusals raise the right exception classes, naming the field.
    for call, field in [
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=4, presence_penalty=0.5), "presence_penalty"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=4, n=2), "n"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1), "temperature"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=100000), "max_tokens"),
    ]:
        try:
            call()
        except openai.BadRequestError as error:
            assert error.body["param"] == field, error.body
        else:
            raise AssertionError(f"{field} was not refused")
    try:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    except openai.NotFoundError as error:
        assert error.body["param"] == "model", error.body
    else:
        raise AssertionError("an unknown model was not refused")
    print("openai client: ok")


if __name__ == "__main__":
    main(sys.argv[1])
