"""benchmarks/grpo.py on a tiny model on the CPU: both rollout engines train through Tunix's GRPO
learner, every step is timed and rewarded, and both engines' logprobs agree with the trainer's
forward (float32)."""

import pytest

pytest.importorskip("tunix.rl.rollout.base_rollout",
                    reason="google-tunix is not installed (make test installs it)")

from benchmarks import grpo  # noqa: E402

TINY = ["--steps", "2", "--layers", "1", "--width", "64", "--heads", "4", "--kv-heads", "2",
        "--vocab", "512", "--tokenizer-files", "20", "--max-tokens", "8", "--generations", "2"]


def test_both_rollouts_train_and_match_the_trainer(tmp_path):
    args = grpo.parse_args(TINY + ["--workdir", str(tmp_path)])
    tokenizer = grpo.write_tokenizer(tmp_path / "tokenizer", args.vocab, args.tokenizer_files)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    results = [grpo.run(engine, args, tokenizer) for engine in ("jpaged", "vanilla")]
    for result in results:
        assert len(result["rollouts"]) == len(result["rewards"]) == 2, result["engine"]
        assert all(seconds > 0 and tokens > 0 for _, seconds, tokens in result["rollouts"])
        assert result["gaps"] and max(g[1] for g in result["gaps"]) < 1e-4, result
        # every step samples each prompt G times, the prompt itself (not a repr of copies)
        for prompts in result["prompts"]:
            assert sorted(prompts) == sorted(grpo.PROMPTS * args.generations), prompts
    text = grpo.summary(results)
    assert text.count("| jpaged |") == text.count("| vanilla |") == 1
    assert "vanilla / jpaged" in text


def test_engine_names_choose_the_decode_steps_per_scheduler_step():
    assert grpo.rollout_options("jpaged") == {}
    assert grpo.rollout_options("jpaged:16") == {"num_scheduler_steps": 16}
    for bad in ("jpaged:x", "jpaged16", "vllm"):
        with pytest.raises(ValueError, match="expected jpaged"):
            grpo.rollout_options(bad)
