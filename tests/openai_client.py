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

    # A seed with greedy decoding: the same answer twice.
    seeded = [
        client.completions.create(model=MODEL, prompt="seed", max_tokens=6, temperature=0, seed=5).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1], seeded

    # Refusals raise the right exception classes, naming the field.
    for call, field in [
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=4, stop=["Y"]), "stop"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2), "logprobs"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0.7), "temperature"),
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
