"""The store's change counter: one integer (``meta`` key ``changes``) that moves whenever a
trial row or a result is written, in the same transaction, so that a reader asks "did the
trials change?" with one lookup (the dashboard keeps its answers until they do).

The store moves it once a transaction that wrote trials or results (a trial submitted, a
status, a placement, a final result, a waiting reason, a result stored or replaced), as it
commits. A write to another table (an environment, an event, a GPU sample, an agent's
sequence number) leaves it as it was. SQLite's ``PRAGMA data_version`` is not it: that moves
on a commit to any table, so a running experiment, which stores GPU samples and agents'
sequence numbers every few seconds, would change it all the time. (Nor are triggers on the
trials: one on insert made storing a trial three times as slow.)

It starts at a random number rather than 0: a store made anew in the same directory does not
take up the numbers of the one a reader kept answers for.
"""

from __future__ import annotations

import secrets
import sqlite3

KEY = "changes"

#: Moves the counter (in the transaction that wrote the trials or results).
MOVE = f"UPDATE meta SET value = value + 1 WHERE key = '{KEY}'"


def install(db: sqlite3.Connection) -> None:
    """Give the store its counter (a store made before it gets it here, when it is opened for
    writing)."""
    db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (KEY, str(secrets.randbits(48))))


def read(db: sqlite3.Connection) -> int | None:
    """The counter; None in a store no version that keeps it has opened for writing."""
    row = db.execute("SELECT value FROM meta WHERE key = ?", (KEY,)).fetchone()
    if row is None or not str(row[0]).isdigit():
        return None
    return int(row[0])
