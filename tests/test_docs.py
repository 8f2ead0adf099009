"""The tree and its docs say what is true now (the checks: tests/doc_checks.py).

No words of the team's process in any file or file name of a fresh clone (``git ls-files
--cached --others --exclude-standard``, binary files' contents skipped); every command README.md
and docs/*.md write names a real module, subcommand, option (from the real argument parsers),
console script and make target; every file they link exists.
"""

from __future__ import annotations

import pytest

from doc_checks import (PROCESS_WORDS, ROOT, UPSTREAM_REF, check_doc, docs, process_words,
                        repo_files, text_of)


def test_no_words_of_the_teams_process_in_the_tree():
    files = repo_files()
    if files is None:
        pytest.skip("not a git checkout")
    problems = []
    for name in sorted(files):
        for m in PROCESS_WORDS.finditer(UPSTREAM_REF.sub("", name)):
            problems.append(f"{name}: file name holds {m.group(0)!r}")
        text = text_of(ROOT / name)
        if text is not None:
            problems += [f"{name}:{line}: {words!r}" for line, words in process_words(text)]
    assert not problems, ("say what a thing is (and date a measurement) instead of naming the "
                          "step of our process it came from:\n" + "\n".join(problems))


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_and_link_in_the_docs_is_real(doc):
    name = doc.relative_to(ROOT).as_posix()
    problems = check_doc(name, doc.read_text(), doc.parent, repo_files())
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_a_doc_gets_wrong():
    """A made-up doc: each wrong command, subcommand, target and link is reported at its line;
    the right ones are not."""
    doc = "\n".join([
        "# A page",
        "",
        "```bash",
        "python -m eagle3_jax.decode --prompt 'Hi' --max-new-tokens 8   # a right one",
        "python -m eagle3_jax.decode --prompt Hi \\",
        "    --no-such-flag 3",  # 6
        "python -m eagle3_jax.bench speed --num-prompts 2 --max-new-tokns 8",
        "python -m eagle3_jax.bench sped --num-prompts 2",
        "python -m eagle3_jax.data prepare --source sharegpt --out d && make demo",
        "make no-such-target",  # 10
        "python -m eagle3_jax.nosuchmodule --x",
        '$LAUNCH --exec "python -m eagle3_jax.export --checkpoint r --out h --nope"',
        "```",
        "",
        "| what | command |",  # 15
        "|---|---|",
        "| plan | `python -m eagle3_jax.plan --config c --topology v5p-8 --fits` |",
        "",
        "See [the guide](nowhere.md), [the readme](../README.md) and `docs/missing.json`;",
        "`eagle3-decode --max-new-tokens 8` and `eagle3-nothing --x`; `make test-fast`.",  # 20
    ])
    problems = check_doc("page.md", doc, ROOT / "docs")
    text = "\n".join(problems)
    expected = [
        "page.md:5: `python -m eagle3_jax.decode` has no option --no-such-flag",
        "page.md:7: `python -m eagle3_jax.bench speed` has no option --max-new-tokns "
        "(did you mean --max-new-tokens?)",
        "page.md:8: `python -m eagle3_jax.bench` has no subcommand 'sped'",
        "page.md:10: the Makefile has no target 'no-such-target'",
        "page.md:11: no module eagle3_jax.nosuchmodule",
        "page.md:12: `python -m eagle3_jax.export` has no option --nope",
        "page.md:17: `python -m eagle3_jax.plan` has no option --fits",
        "page.md:19: link to nowhere.md: no such file",
        "page.md:19: `docs/missing.json`: no such file docs/missing.json",
        "page.md:20: no console script eagle3-nothing",
    ]
    for e in expected:
        assert any(p.startswith(e) for p in problems), f"not reported: {e}\ngot:\n{text}"
    assert len(problems) == len(expected), text


def test_the_process_check_finds_numbered_steps_and_spares_upstream_references():
    word = "st" + "op"
    text = (f"fine line\nmeasured in {word} 21, {word}s 17-19 and ({word}-35)\n"
            "see pytest-dev/pytest-xdist#1378\nthe same " + "sess" + "ion gave\n")
    assert [line for line, _ in process_words(text)] == [2, 2, 2, 4]
    assert PROCESS_WORDS.search(f"docs/bench_forward_{word}27.json")
    assert not PROCESS_WORDS.search("docs/bench_forward_avx2.json")
