"""Checks that keep the tree and its docs true (used by tests/test_docs.py).

* :func:`process_words`: words of the team's own process in a text: a "stop", "issue" or "item"
  with a number (after a space, a hyphen, an underscore or nothing; plurals too), or "this/that/
  same ... session"; a reference to an upstream tracker, ``owner/repo#N``, is fine.
* :func:`check_doc`: every command a markdown doc writes (fenced code with continuation lines
  joined, inline code, tables) runs as written: ``python -m eagle3_jax.X`` names a module that
  runs under ``-m``, its subcommand exists, and each ``--flag`` is one its real argument parser
  (``build_parser()``) accepts, spelled out; console scripts are pyproject.toml's; ``make X``
  names a Makefile target. Every relative link (markdown, reference-style, HTML
  ``src``/``href``, and an inline-code path under ``docs/``, ``eagle3_jax/``, ``tests/``,
  ``launch/`` or ``configs/``) points to a file a fresh clone has.

Only the argument parsers are imported: nothing is compiled. Problems read
``doc:line: what is wrong``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import fnmatch
import functools
import glob
import importlib
import importlib.util
import inspect
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Callable
from urllib.parse import unquote


ROOT = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match itself.
_WORDS = "|".join(("st" + "op", "is" + "sue", "it" + "em"))
PROCESS_WORDS = re.compile(rf"(?<![A-Za-z0-9])(?:{_WORDS})s?[-_ ]?[0-9]+", re.IGNORECASE)
PROCESS_SESSION = re.compile(
    r"\b(?:this|that|same|previous|next|earlier|later|another) " + "sess" + r"ions?\b(?!-)",
    re.IGNORECASE)
UPSTREAM_REF = re.compile(r"\b[\w.-]+/[\w.-]+#[0-9]+")

# What a doc may write as a file path in inline code (repository-relative).
PATH_ROOTS = ("docs", "eagle3_jax", "tests", "launch", "configs")
INLINE_PATH = re.compile(rf"(?:\./)?((?:{'|'.join(PATH_ROOTS)})/[\w./{{}},*+-]*)(?::[\w.]+)?")
MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)"
                     r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REF_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
HTML_LINK = re.compile(r"\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][\w+.-]*:")
FLAG = re.compile(r"--?[A-Za-z][\w-]*(?:=.*)?")
WORD = re.compile(r"[a-z][a-z0-9_-]*")  # a literal subcommand, not a placeholder
MODULE_AT = re.compile(r"-m\s+(eagle3_jax(?:\.[A-Za-z_]\w*)*)")
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>>", "1>", "&>"}
PREFIXES = {"$", "time", "env", "exec", "sudo"}


class DocError(Exception):
    """What is wrong with a command a doc writes."""


# ---------------------------------------------------------------------------------------------
# The repository's files
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def repo_files() -> frozenset[str] | None:
    """Repository-relative paths of the tracked and untracked-not-ignored files that exist on
    disk (what a fresh clone of the next commit holds); None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    names = {n for n in out.decode().split("\0") if n}
    return frozenset(n for n in names if (ROOT / n).is_file())


def text_of(path: Path) -> str | None:
    """A file's text, None for a binary file (a NUL byte or not UTF-8)."""
    with open(path, "rb") as f:
        if b"\0" in f.read(8192):
            return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def process_words(text: str) -> list[tuple[int, str]]:
    """(line, words) of each mention of the team's process in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = UPSTREAM_REF.sub("", line)
        for m in (*PROCESS_WORDS.finditer(line), *PROCESS_SESSION.finditer(line)):
            found.append((number, m.group(0)))
    return found


# ---------------------------------------------------------------------------------------------
# The command lines: modules, console scripts, make targets
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Cli:
    """A command line's options and subcommands. ``options`` None: it takes no options."""
    name: str
    options: dict[str, argparse.Action] | None
    subcommands: dict[str, Callable[[], "Cli"]] | None = None


def cli_of_parser(parser: argparse.ArgumentParser, name: str) -> Cli:
    options = {s: a for a in parser._actions for s in a.option_strings}
    subs = None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs = {k: functools.partial(cli_of_parser, p, f"{name} {k}")
                    for k, p in action.choices.items()}
    return Cli(name, options, subs)


def cli_of_module(module, name: str) -> Cli:
    """The command line ``module`` parses: its ``build_parser()``; or, for a dispatcher with a
    ``COMMANDS`` tuple, ``<command> [options]`` read by ``<package>.<command>``'s parser; or the
    module its ``main`` comes from; or none for a ``main()`` without arguments."""
    if hasattr(module, "build_parser"):
        return cli_of_parser(module.build_parser(), name)
    commands = getattr(module, "COMMANDS", None)
    if commands is not None:
        package = module.__package__

        def sub(command: str) -> Cli:
            return cli_of_module(importlib.import_module(f"{package}.{command}"),
                                 f"{name} {command}")

        return Cli(name, {}, {c: functools.partial(sub, c) for c in commands})
    main = getattr(module, "main", None)
    if main is not None and main.__module__ != module.__name__:
        return cli_of_module(importlib.import_module(main.__module__), name)
    if main is not None and not inspect.signature(main).parameters:
        return Cli(name, None)
    raise DocError(f"{module.__name__} has no build_parser() to read its options from")


@functools.lru_cache(maxsize=None)
def cli_for_module(name: str, label: str | None = None) -> Cli:
    """The command line of ``python -m name`` (``label`` in messages: a console script's name);
    DocError if that runs nothing."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, AttributeError, ValueError):
        spec = None
    if spec is None:
        raise DocError(f"no module {name}")
    run = name
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        run = f"{name}.__main__"
        spec = importlib.util.find_spec(run)
        if spec is None:
            raise DocError(f"package {name} has no __main__.py")
    source = Path(spec.origin).read_text()
    if not re.search(r"""__name__\s*==\s*["']__main__["']""", source):
        raise DocError(f"{name} runs nothing under -m (no `if __name__ == \"__main__\"`)")
    return cli_of_module(importlib.import_module(run), label or f"python -m {name}")


@functools.lru_cache(maxsize=1)
def console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: name -> module."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {k: v.partition(":")[0] for k, v in project.get("scripts", {}).items()}


@functools.lru_cache(maxsize=1)
def distribution_name() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]


def _normal(name: str) -> str:
    """A distribution's name as pip compares them (eagle3_jax is eagle3-jax)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def makefile_targets(text: str) -> set[str]:
    """The targets a Makefile defines (simple ``$(VAR)`` references in their names expanded)."""
    variables: dict[str, str] = {}
    targets: set[str] = set()

    def expand(s: str) -> str:
        for _ in range(10):
            s2 = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), ""), s)
            if s2 == s:
                break
            s = s2
        return s

    for line in text.splitlines():
        if line.startswith("\t") or line.lstrip().startswith("#") or not line.strip():
            continue
        m = re.match(r"(?:export\s+)?([A-Za-z_]\w*)\s*(?::=|\?=|\+=|=)\s*(.*)", line)
        if m:
            variables.setdefault(m.group(1), m.group(2).split("#")[0].strip())
            continue
        m = re.match(r"([^:=#][^:=#]*?)\s*::?(?!=)(.*)", line)
        if m:
            names = m.group(1).split()
            if names == [".PHONY"]:
                targets.update(expand(m.group(2)).split())
            else:
                targets.update(expand(n) for n in names)
    return targets


@functools.lru_cache(maxsize=1)
def make_targets() -> frozenset[str]:
    return frozenset(makefile_targets((ROOT / "Makefile").read_text()))


def tokens_of(command: str) -> list[str]:
    """Shell words of one command line; a comment (a word starting with #) ends it."""
    try:
        lexer = shlex.shlex(command, posix=True)
        lexer.whitespace_split = True
        lexer.commenters = ""
        words = list(lexer)
    except ValueError:  # an unbalanced quote: prose, not shell
        words = command.split()
    out = []
    for w in words:
        if w.startswith("#"):
            break
        if w.endswith(";") and w != ";":  # `a; b`: the separator sticks to the word
            out += [w[:-1], ";"]
        else:
            out.append(w)
    return out


def simple_commands(words: list[str]) -> list[list[str]]:
    """Split at && || ; | &, dropping redirections and their targets."""
    commands, current, skip = [], [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in SEPARATORS:
            commands.append(current)
            current = []
        elif w in REDIRECTS:
            skip = True
        elif re.match(r"^(?:[0-9&]?>>?|<)\S", w) and not re.fullmatch(r"<[^<>]+>", w):
            continue  # >file, 2>&1 (a <placeholder> stays)
        else:
            current.append(w)
    commands.append(current)
    return [c for c in commands if c]


def _clean(word: str) -> str:
    """A word without the brackets that mark it optional in a usage line."""
    return word.lstrip("[(").rstrip("]),")


def _is_flag(word: str) -> bool:
    return bool(FLAG.fullmatch(_clean(word)))


def _consume(action: argparse.Action, args: list[str], i: int) -> int:
    """Index past the values ``action`` takes after its flag at args[i - 1]."""
    nargs = action.nargs
    if nargs == 0:
        return i
    if nargs in (None, "?"):
        return i + 1 if i < len(args) and not (nargs == "?" and _is_flag(args[i])) else i
    if isinstance(nargs, int):
        return i + nargs
    if nargs == argparse.REMAINDER:
        return len(args)
    while i < len(args) and not _is_flag(args[i]):  # "*" or "+"
        i += 1
    return i


def check_args(cli: Cli, args: list[str]) -> list[str]:
    """What is wrong with ``args`` as written for ``cli``: unknown flags and subcommands."""
    problems, i = [], 0
    while i < len(args):
        word = _clean(args[i])
        i += 1
        if word in ("", "...", "…", "\\"):
            continue
        if FLAG.fullmatch(word):
            flag, eq, _ = word.partition("=")
            if cli.options is None:
                problems.append(f"`{cli.name}` takes no options, got {flag}")
                continue
            action = cli.options.get(flag)
            if action is None:
                longer = [o for o in cli.options if o.startswith(flag)]
                near = longer or difflib.get_close_matches(flag, list(cli.options), n=1)
                problems.append(f"`{cli.name}` has no option {flag}"
                                + (f" (did you mean {near[0]}?)" if near else ""))
                continue
            if not eq:
                i = _consume(action, args, i)
        elif cli.subcommands is not None:
            if not WORD.fullmatch(word):
                return problems  # a placeholder for the subcommand: its options are unknown
            if word not in cli.subcommands:
                problems.append(f"`{cli.name}` has no subcommand {word!r} "
                                f"(it has {', '.join(sorted(cli.subcommands))})")
                return problems
            cli = cli.subcommands[word]()
    return problems


def check_command(command: str) -> list[str]:
    """What is wrong with one line of shell a doc writes."""
    problems = []
    for words in simple_commands(tokens_of(command)):
        for w in words:  # a command passed as one quoted argument (`launcher --exec "..."`)
            if " " in w and (MODULE_AT.search(w) or re.match(r"eagle3-\w", w)):
                problems += check_command(w)
        while words and (words[0] in PREFIXES or re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0])):
            words = words[1:]
        if not words:
            continue
        head = words[0].rsplit("/", 1)[-1]
        if head == "make":
            for w in words[1:]:
                if w.startswith("-") or "=" in w:
                    continue
                if w not in make_targets():
                    near = difflib.get_close_matches(w, sorted(make_targets()), n=1)
                    problems.append(f"the Makefile has no target {w!r}"
                                    + (f" (did you mean {near[0]}?)" if near else ""))
            continue
        if head.startswith("eagle3-") and _normal(head) != _normal(distribution_name()):
            module = console_scripts().get(head)
            if module is None:
                problems.append(f"no console script {head} in pyproject.toml "
                                f"(there are {', '.join(sorted(console_scripts()))})")
                continue
            try:
                problems += check_args(cli_for_module(module, head), words[1:])
            except DocError as e:
                problems.append(str(e))
            continue
        for k, w in enumerate(words[:-1]):
            if w == "-m" and words[k + 1].startswith("eagle3_jax"):
                try:
                    cli = cli_for_module(words[k + 1].rstrip(".,;:"))
                except DocError as e:
                    problems.append(str(e))
                else:
                    problems += check_args(cli, words[k + 2:])
                break
    return problems


# ---------------------------------------------------------------------------------------------
# Markdown: code, inline code, links
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Snippet:
    line: int
    text: str


def split_markdown(text: str) -> tuple[list[Snippet], list[Snippet]]:
    """(the logical lines of fenced code, continuations joined; the prose paragraphs)."""
    code, prose = [], []
    lines = text.split("\n")
    fence: str | None = None
    pending: Snippet | None = None
    paragraph: Snippet | None = None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        opener = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and opener:
            if paragraph:
                prose.append(paragraph)
                paragraph = None
            fence = opener.group(1)[0] * 3
            continue
        if fence is not None:
            if stripped.startswith(fence) and not stripped.strip(fence[0]):
                if pending:
                    code.append(pending)
                fence, pending = None, None
                continue
            if pending is None:
                pending = Snippet(number, "")
            if line.rstrip().endswith("\\"):
                pending.text += line.rstrip()[:-1] + " "
            else:
                pending.text += line
                code.append(pending)
                pending = None
            continue
        if not stripped:
            if paragraph:
                prose.append(paragraph)
            paragraph = None
        elif paragraph is None:
            paragraph = Snippet(number, line)
        else:
            paragraph.text += "\n" + line
    if paragraph:
        prose.append(paragraph)
    if pending:
        code.append(pending)
    return code, prose


INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def _line(paragraph: Snippet, text: str, offset: int) -> int:
    """The doc's line number of ``offset`` in ``text`` (the paragraph's text or a copy)."""
    return paragraph.line + text.count("\n", 0, offset)


def inline_code(paragraph: Snippet) -> list[Snippet]:
    """The inline code spans of a paragraph, each at the line it starts on."""
    return [Snippet(_line(paragraph, paragraph.text, m.start()),
                    m.group(2).replace("\n", " ").replace("\\|", "|").strip())
            for m in INLINE_CODE.finditer(paragraph.text)]


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",")
            for p in _expand_braces(path[:m.start()] + alt + path[m.end():])]


def _exists(relative: str, files: frozenset[str] | None) -> bool:
    """Whether a repository-relative file or folder is in a fresh clone."""
    relative = relative.rstrip("/")
    path = (ROOT / relative).resolve()
    if not path.is_relative_to(ROOT) or not path.exists():
        return False
    if files is None:
        return True
    rel = path.relative_to(ROOT).as_posix()
    if path.is_dir():
        return rel == "." or any(f.startswith(rel + "/") for f in files)
    return rel in files


def check_link(target: str, doc_dir: Path, files: frozenset[str] | None) -> str | None:
    target = target.strip("<>")
    if not target or target.startswith(("#", "//")) or SCHEME.match(target):
        return None
    path = unquote(re.split(r"[#?]", target, maxsplit=1)[0])
    if not path:
        return None
    base = ROOT if path.startswith("/") else doc_dir
    relative = (base / path.lstrip("/")).resolve()
    if not relative.is_relative_to(ROOT):
        return f"link to {target}: outside the repository"
    if not _exists(relative.relative_to(ROOT).as_posix(), files):
        return f"link to {target}: no such file"
    return None


def check_inline_path(span: str, files: frozenset[str] | None) -> str | None:
    m = INLINE_PATH.fullmatch(span)
    if not m:
        return None
    for path in _expand_braces(m.group(1)):
        if "*" in path:
            matches = (fnmatch.filter(files, path) if files is not None
                       else glob.glob(str(ROOT / path)))
            if not matches:
                return f"`{span}`: no file matches {path}"
        elif not _exists(path, files):
            return f"`{span}`: no such file {path}"
    return None


def check_doc(name: str, text: str, doc_dir: Path,
              files: frozenset[str] | None = None) -> list[str]:
    """Every problem of one markdown doc, as ``name:line: problem``."""
    problems = []
    code, prose = split_markdown(text)
    for snippet in code:
        problems += [f"{name}:{snippet.line}: {p}" for p in check_command(snippet.text)]
    for paragraph in prose:
        spans = inline_code(paragraph)
        for span in spans:
            problems += [f"{name}:{span.line}: {p}" for p in check_command(span.text)]
            bad_path = check_inline_path(span.text, files)
            if bad_path:
                problems.append(f"{name}:{span.line}: {bad_path}")
        # Links and module names in the prose itself, inline code blanked (offsets kept).
        bare = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), paragraph.text)
        for pattern in (MD_LINK, REF_LINK, HTML_LINK):
            for m in pattern.finditer(bare):
                bad = check_link(m.group(1), doc_dir, files)
                if bad:
                    problems.append(f"{name}:{_line(paragraph, bare, m.start())}: {bad}")
        for m in MODULE_AT.finditer(bare):
            try:
                cli_for_module(m.group(1).rstrip("."))
            except DocError as e:
                problems.append(f"{name}:{_line(paragraph, bare, m.start())}: {e}")
    return problems


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
