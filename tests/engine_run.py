"""Run one request through an engine to the end: the helper tests of start-up and of the program
store share."""

from jpaged import SamplingParams


def greedy_tokens(engine, prompt, max_tokens: int) -> list[int]:
    """The greedy tokens of one request with `prompt` (token ids), stepped to its end."""
    engine.add_request("r", prompt_token_ids=list(prompt),
                       params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                return list(output.outputs[0].token_ids)
    raise AssertionError("the request did not finish")
