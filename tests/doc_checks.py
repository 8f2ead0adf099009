"""Checks that keep the tree and its docs true (used by tests/test_docs.py).

* :func:`process_words`: words of the team's own process in a text: a "stop", "issue" or "item"
  with a number (after a space, a hyphen, an underscore or nothing; plurals too), or "this/that/
  same ... session"; a reference to an upstream tracker, ``owner/repo#N``, is fine.
* :func:`check_doc`: every command a markdown doc writes (in code blocks, inline code and
  tables) runs as written: ``python -m eagle3_jax.X`` names a module that runs under ``-m``,
  its subcommand exists, and each ``--flag`` is one its real argument parser
  (``build_parser()``) accepts, spelled out; console scripts are pyproject.toml's; ``make X``
  names a Makefile target. Every relative link (markdown, HTML ``src``/``href``, an inline-code
  path under docs/, eagle3_jax/, tests/, launch/ or configs/) names a file a fresh clone has.

markdown-it-py reads the markdown, :mod:`shlex` the shell words; only the argument parsers are
imported (nothing is compiled). Problems read ``doc:line: what is wrong``.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import functools
import importlib
import importlib.util
import inspect
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import unquote

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSOLE_SCRIPTS = {k: v.partition(":")[0] for k, v in PROJECT.get("scripts", {}).items()}
DISTRIBUTION = re.sub(r"[-_.]+", "-", PROJECT["name"]).lower()  # as pip spells it: eagle3-jax
# The Makefile's targets: each rule's names before its colon, and the names .PHONY lists.
MAKE_TARGETS = frozenset(
    target for names, deps in re.findall(r"^([^\t#\s=:][^#=:\n]*?)\s*::?(?!=)(.*)$",
                                         (ROOT / "Makefile").read_text(), re.MULTILINE)
    for target in (deps if names == ".PHONY" else names).split())

# Built from pieces so that this file does not match itself.
_WORDS = "|".join(("st" + "op", "is" + "sue", "it" + "em"))
PROCESS_WORDS = re.compile(rf"(?<![A-Za-z0-9])(?:{_WORDS})s?[-_ ]?[0-9]+", re.IGNORECASE)
PROCESS_SESSION = re.compile(
    r"\b(?:this|that|same|previous|next|earlier|later|another) " + "sess" + r"ions?\b(?!-)",
    re.IGNORECASE)
UPSTREAM_REF = re.compile(r"\b[\w.-]+/[\w.-]+#[0-9]+")

# An inline-code span that is a repository-relative path (braces and * allowed, `:name` after).
INLINE_PATH = re.compile(r"(?:\./)?((?:docs|eagle3_jax|tests|launch|configs)/[\w./{},*+-]*)"
                         r"(?::[\w.]+)?")
HTML_LINK = re.compile(r"\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
FLAG = re.compile(r"--?[A-Za-z][\w-]*(?:=.*)?")
SUBCOMMAND = re.compile(r"[a-z][a-z0-9_-]*")  # a literal subcommand, not a <placeholder>
MODULE_AT = re.compile(r"-m\s+(eagle3_jax(?:\.[A-Za-z_]\w*)*)")
SEPARATORS = {"&&", "||", ";", "|", "&"}
PREFIXES = {"$", "time", "env", "exec", "sudo"}
MARKDOWN = MarkdownIt("commonmark", {"html": True}).enable("table")


class DocError(Exception):
    """What is wrong with a command a doc writes."""


# --- The repository's files -----------------------------------------------------------------

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
    return frozenset(n for n in out.decode().split("\0") if n and (ROOT / n).is_file())


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
    return [(number, m.group(0)) for number, line in enumerate(text.splitlines(), 1)
            for words in (PROCESS_WORDS, PROCESS_SESSION)
            for m in words.finditer(UPSTREAM_REF.sub("", line))]


# --- Command lines: modules, console scripts, make targets ------------------------------------

def parser_of(module) -> argparse.ArgumentParser | None:
    """The argument parser ``module`` reads: its ``build_parser()``; for a dispatcher with a
    ``COMMANDS`` tuple, one whose subcommands are the parsers of ``<package>.<command>``; that of
    the module its ``main`` comes from; None for a ``main()`` without arguments."""
    if hasattr(module, "build_parser"):
        return module.build_parser()
    if hasattr(module, "COMMANDS"):
        parser = argparse.ArgumentParser(add_help=False)
        commands = parser.add_subparsers().choices
        for c in module.COMMANDS:
            commands[c] = parser_of(importlib.import_module(f"{module.__package__}.{c}"))
        return parser
    main = getattr(module, "main", None)
    if main is not None and main.__module__ != module.__name__:
        return parser_of(importlib.import_module(main.__module__))
    if main is not None and not inspect.signature(main).parameters:
        return None
    raise DocError(f"{module.__name__} has no build_parser() to read its options from")


@functools.lru_cache(maxsize=None)
def parser_for_module(name: str) -> argparse.ArgumentParser | None:
    """The argument parser of ``python -m name``; DocError if that runs nothing."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            name, spec = f"{name}.__main__", importlib.util.find_spec(f"{name}.__main__")
    except ImportError:  # a parent that is not a package
        spec = None
    if spec is None:
        raise DocError(f"no module {name}")
    if not re.search(r"""__name__\s*==\s*["']__main__["']""", Path(spec.origin).read_text()):
        raise DocError(f"{name} runs nothing under -m (no `if __name__ == \"__main__\"`)")
    return parser_of(importlib.import_module(name))


def _did_you_mean(word: str, names) -> str:
    """A name that starts with ``word`` or is close to it, as " (did you mean NAME?)"."""
    near = ([n for n in sorted(names) if n.startswith(word)]
            or difflib.get_close_matches(word, sorted(names), n=1))
    return f" (did you mean {near[0]}?)" if near else ""


def simple_commands(line: str) -> list[list[str]]:
    """The shell words of one line, split at && || ; | & into commands; a comment ends the
    line; redirections (``> file``, ``2>&1``, not a ``<placeholder>``) are dropped."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: prose, not shell
        words = line.split()
    commands, skip = [[]], False
    for w in words:
        if skip:
            skip = False
        elif w in SEPARATORS:
            commands.append([])
        elif w.endswith(";"):  # `a; b`: the separator sticks to the word
            commands[-1].append(w[:-1])
            commands.append([])
        elif re.fullmatch(r"[0-9&]?>>?|<", w):
            skip = True
        elif not re.match(r"[0-9&]?>|<", w) or re.fullmatch(r"<[^<>]+>", w):
            commands[-1].append(w)
    return [c for c in commands if c]


def _read(parser: argparse.ArgumentParser | None) -> tuple[dict | None, dict | None]:
    """(flag -> argparse action, subcommand -> parser) of ``parser``; None: it has none."""
    if parser is None:
        return None, None
    return ({s: a for a in parser._actions for s in a.option_strings},
            next((a.choices for a in parser._actions
                  if isinstance(a, argparse._SubParsersAction)), None))


def check_args(name: str, parser: argparse.ArgumentParser | None, args: list[str]) -> list[str]:
    """Unknown flags and subcommands in ``args`` as written for ``parser`` (``name`` in
    messages). A word after a flag that takes a value is its value; brackets of a usage line
    (``[--flag]``) are ignored."""
    (options, subcommands), problems, is_value = _read(parser), [], False
    for word in (w.lstrip("[(").rstrip("]),") for w in args):
        if FLAG.fullmatch(word):
            flag, eq, _ = word.partition("=")
            if options is None:
                problems.append(f"`{name}` takes no options, got {flag}")
            elif flag not in options:
                problems.append(f"`{name}` has no option {flag}{_did_you_mean(flag, options)}")
            action = (options or {}).get(flag)
            is_value = action is not None and not eq and action.nargs != 0
        elif is_value:
            is_value = False
        elif subcommands is not None:
            if not SUBCOMMAND.fullmatch(word):
                break  # a placeholder for the subcommand: its options are unknown
            if word not in subcommands:
                problems.append(f"`{name}` has no subcommand {word!r} "
                                f"(it has {', '.join(sorted(subcommands))})")
                break
            name, (options, subcommands) = f"{name} {word}", _read(subcommands[word])
    return problems


def check_command(line: str) -> list[str]:
    """What is wrong with one line of shell a doc writes."""
    problems = []
    for words in simple_commands(line):
        for w in words:  # a command passed as one quoted argument (`launcher --exec "..."`)
            if " " in w and (MODULE_AT.search(w) or re.match(r"eagle3-\w", w)):
                problems += check_command(w)
        while words and (words[0] in PREFIXES or re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0])):
            words = words[1:]  # `$ `, `time`, `VAR=value` before the command
        head = words[0].rsplit("/", 1)[-1] if words else ""
        module = next((k for k, w in enumerate(words[:-1])
                       if w == "-m" and words[k + 1].startswith("eagle3_jax")), None)
        try:
            if head == "make":
                problems += [f"the Makefile has no target {w!r}" + _did_you_mean(w, MAKE_TARGETS)
                             for w in words[1:]
                             if not w.startswith("-") and "=" not in w and w not in MAKE_TARGETS]
            elif head.startswith("eagle3-") and head != DISTRIBUTION:
                if head not in CONSOLE_SCRIPTS:
                    raise DocError(f"no console script {head} in pyproject.toml "
                                   f"(there are {', '.join(sorted(CONSOLE_SCRIPTS))})")
                problems += check_args(head, parser_for_module(CONSOLE_SCRIPTS[head]), words[1:])
            elif module is not None:
                name = words[module + 1].rstrip(".,;:")
                problems += check_args(f"python -m {name}", parser_for_module(name),
                                       words[module + 2:])
        except DocError as e:
            problems.append(str(e))
    return problems


# --- Links and paths --------------------------------------------------------------------------

def _exists(path: Path, files: frozenset[str] | None) -> bool:
    """Whether a file or folder (an absolute path) is in a fresh clone."""
    path = path.resolve()
    if not path.is_relative_to(ROOT) or not path.exists():
        return False
    rel = path.relative_to(ROOT).as_posix()
    if files is None or rel == ".":
        return True
    return any(f.startswith(rel + "/") for f in files) if path.is_dir() else rel in files


def check_link(target: str, doc_dir: Path, files: frozenset[str] | None) -> str | None:
    """What is wrong with a link's target: a relative path that is not in a fresh clone."""
    path = unquote(re.split(r"[#?]", target, maxsplit=1)[0])
    if not path or target.startswith("//") or re.match(r"[A-Za-z][\w+.-]*:", target):
        return None  # an anchor in this doc, or a URL
    path = (ROOT if path.startswith("/") else doc_dir) / path.lstrip("/")
    if not path.resolve().is_relative_to(ROOT):
        return f"link to {target}: outside the repository"
    return None if _exists(path, files) else f"link to {target}: no such file"


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    return [p for alt in m.group(1).split(",")
            for p in _expand_braces(path[:m.start()] + alt + path[m.end():])] if m else [path]


def check_inline_path(span: str, files: frozenset[str] | None) -> str | None:
    """What is wrong with an inline-code path (``docs/x.md``, ``configs/*.yaml``)."""
    m = INLINE_PATH.fullmatch(span)
    for path in _expand_braces(m.group(1)) if m else []:
        if "*" not in path and not _exists(ROOT / path, files):
            return f"`{span}`: no such file {path}"
        if "*" in path and not (fnmatch.filter(files, path) if files is not None
                                else list(ROOT.glob(path))):
            return f"`{span}`: no file matches {path}"
    return None


# --- Markdown ---------------------------------------------------------------------------------

def check_doc(name: str, text: str, doc_dir: Path,
              files: frozenset[str] | None = None) -> list[str]:
    """Every problem of one markdown doc, as ``name:line: problem``."""
    problems = []

    def report(line: int, found) -> None:  # line: 0-based, as markdown-it counts
        problems.extend(f"{name}:{line + 1}: {p}" for p in found if p)

    for token in MARKDOWN.parse(text):
        if token.type in ("fence", "code_block"):
            line = token.map[0] + (token.type == "fence")
            for command in re.split(r"(?<!\\)\n", token.content):
                report(line, check_command(command.replace("\\\n", " ")))
                line += command.count("\n") + 1
        elif token.type == "html_block":
            for m in HTML_LINK.finditer(token.content):
                report(token.map[0] + token.content.count("\n", 0, m.start()),
                       [check_link(m.group(1), doc_dir, files)])
        elif token.type == "inline":  # a paragraph, heading or table cell
            line = token.map[0]
            for child in token.children:
                if child.type in ("softbreak", "hardbreak"):  # (a code span that wraps holds none)
                    line += 1
                elif child.type == "code_inline":
                    report(line, [*check_command(child.content),
                                  check_inline_path(child.content, files)])
                elif child.type in ("link_open", "image"):
                    target = child.attrs.get("href", child.attrs.get("src"))
                    report(line, [check_link(str(target), doc_dir, files)])
                elif child.type == "html_inline":
                    report(line, [check_link(m.group(1), doc_dir, files)
                                  for m in HTML_LINK.finditer(child.content)])
                elif child.type == "text":  # a module named in prose: `run -m eagle3_jax.x`
                    for m in MODULE_AT.finditer(child.content):
                        try:
                            parser_for_module(m.group(1).rstrip("."))
                        except DocError as e:
                            report(line, [str(e)])
    return problems


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
