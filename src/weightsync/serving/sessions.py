"""One trainer per server at a time: each trainer engine sends its own session id with every
init and update; an init of another session takes the server over and ends the one before,
whose updates are refused from then on (so it never loads another trainer's weights under
its own label). Nothing here imports an inference engine."""

from __future__ import annotations

import logging
from typing import Any

from weightsync.core.errors import TrainerSessionEndedError

logger = logging.getLogger(__name__)

#: how many ended trainer sessions a server remembers (their updates and inits are refused)
ENDED_SESSIONS = 64
#: in every refusal of a session (the trainer finds it in the server's error text)
ONE_TRAINER = "one trainer per server at a time"
#: a trainer session id: what ``secrets.token_hex`` makes, bounded
_SESSION_CHARS = frozenset("0123456789abcdefABCDEF")


def checked_session(session: Any, what: str) -> str:
    """A trainer session id as it came in ``init_info``/``update_info``: "" (none, e.g. a
    direct call) or 8 to 64 hex digits; ValueError naming ``what`` otherwise."""
    if session is None or session == "":
        return ""
    if (not isinstance(session, str) or not 8 <= len(session) <= 64
            or not set(session) <= _SESSION_CHARS):
        raise ValueError(f"{what} must be a trainer session id (8 to 64 hex digits, as the "
                         f"weightsync trainer engine sends), got {session!r}")
    return session


def session_name(session: str | None) -> str:
    """How a refusal names a session ("" and None: an init that carried none)."""
    return f"trainer session {session}" if session else "an init without a trainer session"


class ServerSessions:
    """The trainer session that initialised one server last (None: never initialised, ""
    an init without a session), and the sessions that ended there, each with the one that
    took over. ``where`` names the server in every refusal."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.current: str | None = None
        self.ended: dict[str, str] = {}  # ended session -> the one that took over

    def take(self, session: str) -> None:
        """An init of ``session``: it ends the current session if it is another one; a
        session once ended cannot come back (a new trainer engine takes the server back).
        An init without a session (a direct call) is never refused."""
        if session and session in self.ended:
            taken_by = self.ended[session]
            raise TrainerSessionEndedError(
                f"{self.where}: refused an init of trainer session {session}: it ended when "
                f"{session_name(taken_by)} took this server over ({ONE_TRAINER}); a new "
                "trainer engine (a new session) takes it back",
                session=session, taken_by=taken_by)
        current = self.current
        if current is not None and current != session:
            if current:
                self.ended[current] = session
                while len(self.ended) > ENDED_SESSIONS:
                    del self.ended[next(iter(self.ended))]
            logger.warning("%s: %s takes this server over from %s; updates of the latter are "
                           "refused from now on", self.where, session_name(session),
                           session_name(current))
        self.current = session

    def check(self, session: str, version: int | None) -> None:
        """Refuse an update (of ``version``; None: the newest) of a session other than the
        one that initialised this server last; an update without a session is not checked."""
        if not session or session == self.current or self.current is None:
            return  # None: never initialised (the update says to init first)
        what = "an update" if version is None else f"version {version}"
        if session in self.ended:
            taken_by = self.ended[session]
            raise TrainerSessionEndedError(
                f"{self.where}: refused {what} of trainer session {session}: "
                f"{session_name(taken_by)} initialised this server since and took it over "
                f"({ONE_TRAINER}), so session {session} ended; the server keeps serving "
                f"what {session_name(taken_by)} loaded. Stop one of the trainers; a new "
                "trainer engine takes the server back at its init",
                session=session, taken_by=taken_by)
        raise TrainerSessionEndedError(
            f"{self.where}: refused {what} of trainer session {session}: {ONE_TRAINER}, and "
            f"this server was initialised last by {session_name(self.current)}, not by "
            f"session {session}", session=session, taken_by=self.current)
