"""``lmlab generate``: streamed text, a file of prompts as one batch, and bad input refused with exit 2."""

import json
import shutil

import pytest

from lmlab.cli.main import main


def generate(run_dir, *args) -> list[str]:
    return ["generate", str(run_dir), "--max-new-tokens", "24", *args]


def test_a_file_of_prompts_is_one_batch_whose_texts_equal_each_prompt_alone(trained_run, tmp_path, capsys):
    prompts = ["ROMEO:", "First Citizen: We are", "O", "KING HENRY VI: What says"]  # one per line
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    assert main(generate(trained_run, "--prompts", str(path))) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    assert "tokens/s" in captured.err and "4 prompts" in captured.err
    for line in lines:
        assert main(generate(trained_run, "--prompt", line["prompt"])) == 0
        assert capsys.readouterr().out == line["prompt"] + line["text"] + "\n"


def test_jsonl_prompts_and_the_paged_cache_give_the_same_texts(trained_run, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["ROMEO:", "To be, or"]) + "\n")
    texts = {}
    for cache in ("contiguous", "paged"):
        assert main(generate(trained_run, "--prompts", str(path), "--cache", cache)) == 0
        texts[cache] = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    assert texts["contiguous"] == texts["paged"] and len(texts["paged"]) == 2


def test_a_stop_string_ends_the_text_before_it(trained_run, capsys):
    assert main(generate(trained_run, "--prompt", "ROMEO:")) == 0
    full = capsys.readouterr().out[len("ROMEO:"):-1]
    stop = full[5:7]
    assert main(generate(trained_run, "--prompt", "ROMEO:", "--stop", stop)) == 0
    assert capsys.readouterr().out == "ROMEO:" + full[:full.index(stop)] + "\n"


@pytest.mark.parametrize("args, key", [
    (["--stop", ""], "--stop"),
    (["--set", "decoding.use=beam", "--set", "decoding.width=0"], "decoding.width"),
    (["--prompts", "missing.txt"], "--prompts"),
])
def test_bad_input_is_one_line_and_exit_2(trained_run, args, key, capsys):
    assert main(generate(trained_run, *args)) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_draft_with_another_tokenizer_is_refused_naming_the_option(trained_run, tmp_path, capsys):
    draft = shutil.copytree(trained_run, tmp_path / "draft")
    vocab_file = draft / "tokenizer" / "char_vocab.json"
    vocab = json.loads(vocab_file.read_text())
    vocab["chars"][-1], vocab["chars"][-2] = vocab["chars"][-2], vocab["chars"][-1]
    vocab_file.write_text(json.dumps(vocab))
    assert main(generate(trained_run, "--set", "decoding.use=speculative", "--set", f"decoding.draft={draft}")) == 2
    err = capsys.readouterr().err.strip()
    assert "decoding.draft" in err and "different tokenizer" in err and len(err.splitlines()) == 1


def test_speculative_decoding_with_the_run_as_its_own_draft_gives_the_greedy_text(trained_run, capsys):
    assert main(generate(trained_run, "--prompt", "ROMEO:")) == 0
    greedy = capsys.readouterr().out
    assert main(generate(trained_run, "--prompt", "ROMEO:", "--set", "decoding.use=speculative",
                         "--set", f"decoding.draft={trained_run}")) == 0
    out, err = capsys.readouterr()
    assert out == greedy
    # The acceptance rate is printed with the speed: its own draft proposes what it accepts.
    assert "100% of" in err and "drafted tokens accepted" in err


def new_tokens(err: str) -> int:
    return int(err.strip().splitlines()[-1].split(" new tokens")[0])


def test_a_stop_string_ends_speculative_decodings_count_where_greedys_ends(trained_run, capsys):
    """Tokens a speculative round drafted past the stop string are not counted (issue 40: 13/7/14
    against greedy's 12/5/11), so its tokens/s is not inflated."""
    assert main(generate(trained_run, "--prompt", "ROMEO:")) == 0
    full = capsys.readouterr().out[len("ROMEO:"):-1]
    stop = full[6:8]
    counts = {}
    for use, extra in (("greedy", []), ("speculative", ["--set", f"decoding.draft={trained_run}"])):
        assert main(generate(trained_run, "--prompt", "ROMEO:", "--stop", stop, "--set", f"decoding.use={use}",
                             *extra)) == 0
        out, err = capsys.readouterr()
        assert out == "ROMEO:" + full[:full.index(stop)] + "\n"
        counts[use] = new_tokens(err)
    assert counts["speculative"] == counts["greedy"]


def test_a_static_step_setting_that_cannot_act_is_said_to_be_ignored(trained_run, capsys):
    assert main(generate(trained_run, "--prompt", "O", "--set", "decoding.cuda_graph=true")) == 0
    assert "lmlab: warning: decoding.cuda_graph: ignored on the cpu" in capsys.readouterr().err
    assert main(generate(trained_run, "--prompt", "O", "--set", "decoding.compile=true", "--cache", "paged")) == 0
    assert "lmlab: warning: decoding.compile: ignored with the paged cache" in capsys.readouterr().err


def test_beam_candidates_end_at_the_stop_string_as_the_answer_does():
    """A beam search's candidates are cut where their completion would be, at a stop string or the
    end-of-text token (issue 40: `lmlab generate` printed them whole, past the stop string)."""
    from lmlab.generation.outputs import Outputs

    class Letters:
        vocab_size = 27

        def decode(self, ids):
            return "".join(" abcdefghijklmnopqrstuvwxyz"[i] for i in ids)

    outputs = Outputs(Letters(), [10], stop=[[" th"]], eos_id=26)
    # "and the", "and then", "an ox" + end of text + "yy": each offered whole, as a beam search offers them.
    offered = [([1, 14, 4, 0, 20, 8, 5], -1.0), ([1, 14, 4, 0, 20, 8, 5, 14], -2.0), ([1, 14, 0, 15, 24, 26, 25, 25], -3.0)]
    outputs.offer(0, offered)
    assert outputs.candidate_texts(0) == [("and", -1.0), ("and", -2.0), ("an ox", -3.0)]


def test_the_ngram_ban_and_repetition_penalty_reach_the_decoder_through_the_core(trained_run, capsys):
    """The 6-step model loops on one character; banning repeated bigrams (or penalising repeats) breaks
    the loop, which the decoder can only do with the history the core's decoding loop keeps."""
    assert main(generate(trained_run, "--prompt", "ROMEO:")) == 0
    plain = capsys.readouterr().out[len("ROMEO:"):-1]
    bigrams = lambda text: [text[i:i + 2] for i in range(len(text) - 1)]  # noqa: E731
    assert len(set(bigrams(plain))) < len(bigrams(plain))  # it repeats itself
    assert main(generate(trained_run, "--prompt", "ROMEO:", "--set", "decoding.no_repeat_ngram_size=2")) == 0
    banned = capsys.readouterr().out[:-1]  # the prompt's bigrams count too
    assert len(set(bigrams(banned))) == len(bigrams(banned))
    assert main(generate(trained_run, "--prompt", "ROMEO:", "--set", "decoding.repetition_penalty=3.0")) == 0
    assert capsys.readouterr().out[len("ROMEO:"):-1] != plain
