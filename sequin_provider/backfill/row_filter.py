"""A backfill's row condition: SQL over the table's columns that its rows must match
(``status = 'paid' AND region = 'eu'``), Sequin's "republish the messages that match a query".

The condition is SQL run on the source with the backfill's credentials, for operators (as a partial
backfill's start position is). It is checked twice before anything is recorded: lexically here (one
expression: no ``;``, no comment, balanced parentheses outside literals, so that every page can hold
it in parentheses AND-ed with its keyset predicate without changing that predicate), then by the
source itself (``check_row_filter``: ``EXPLAIN`` of a select with it, read only and rolled back), so
an unknown column, a syntax error or a non-boolean condition is refused with Postgres' own reason.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg import sql

from sequin_provider.exceptions import BackfillError

CHECK_TIMEOUT_MS = 10_000
"""The ``statement_timeout`` of the source's check (an ``EXPLAIN``: planning only)."""

_DOLLAR_TAG = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$")


def _in_word(c: str) -> bool:
    """Whether ``c`` continues an identifier or a keyword (so a quote after it starts no E'' string)."""
    return c.isalnum() or c in "_$"


def normalize_row_filter(where: str | None, what: str = "backfill condition") -> str | None:
    """The condition stripped, None when empty; ``BackfillError`` when it is not one SQL expression
    (a ``;``, a comment, unbalanced parentheses or an unterminated literal). ``what`` names the
    condition in the error (a replay's is checked the same way)."""
    if where is None or not where.strip():
        return None
    text = where.strip()
    depth = 0
    i = 0
    while i < len(text):
        c = text[i]
        if c in "'\"":  # a string literal (E'' too: its backslash escapes) or a quoted identifier
            escapes = c == "'" and i > 0 and text[i - 1] in "eE" and (i == 1 or not _in_word(text[i - 2]))
            j = i + 1
            while True:
                if j >= len(text):
                    literal = "string" if c == "'" else "quoted identifier"
                    raise BackfillError(f"{what} {where!r}: unterminated {literal}")
                if escapes and text[j] == "\\":
                    j += 2
                    continue
                if text[j] == c:
                    if j + 1 < len(text) and text[j + 1] == c:  # a doubled quote
                        j += 2
                        continue
                    break
                j += 1
            i = j + 1
            continue
        if c == "$" and (tag := _DOLLAR_TAG.match(text, i)) is not None and not (i > 0 and _in_word(text[i - 1])):
            end = text.find(tag.group(0), tag.end())
            if end < 0:
                raise BackfillError(f"{what} {where!r}: unterminated dollar-quoted string")
            i = end + len(tag.group(0))
            continue
        if c == ";":
            raise BackfillError(f"{what} {where!r}: ';' is not allowed (one condition, not statements)")
        if text.startswith("--", i) or text.startswith("/*", i):
            raise BackfillError(f"{what} {where!r}: comments are not allowed")
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise BackfillError(f"{what} {where!r}: unbalanced parentheses")
        i += 1
    if depth:
        raise BackfillError(f"{what} {where!r}: unbalanced parentheses")
    return text


def row_filter_sql(where: str) -> sql.Composable:
    """The condition in parentheses, to AND with a page's other conditions."""
    return sql.SQL("({})").format(sql.SQL(where))


def check_row_filter(source: psycopg.Connection[Any], table: sql.Identifier, where: str | None) -> str | None:
    """``normalize_row_filter``, then the source's own check: ``EXPLAIN SELECT 1 FROM table WHERE
    (where)`` in a read-only transaction that is rolled back. Returns the condition to record."""
    text = normalize_row_filter(where)
    if text is None:
        return None
    try:
        with source.transaction():
            source.execute("SET LOCAL transaction_read_only = on")
            source.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(CHECK_TIMEOUT_MS)))
            source.execute(sql.SQL("EXPLAIN SELECT 1 FROM {} WHERE {}").format(table, row_filter_sql(text)))
            raise psycopg.Rollback()
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackfillError(f"backfill condition {text!r} is not valid on the source: {reason}") from None
    return text
