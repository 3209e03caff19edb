"""An email as toko sends it: its fields, its MIME form, its Message-ID.

The Message-ID is derived from the job (id and enqueue time), identical on
every retry, so a duplicate after a crash (delivery is at-least-once) is
detectable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.header import Header
from email.headerregistry import BaseHeader, HeaderRegistry
from email.message import EmailMessage
from email.policy import default as default_policy
from email.utils import formatdate


class _HeaderClasses(HeaderRegistry):
    """The email package's header registry, making each header's class once.

    The stock one builds a new class (``type(...)``) for every header of
    every message: a third of the CPU of building and flattening an email
    (600 µs a message here, 400 µs with the classes kept), and garbage that
    only the cycle collector frees. A header class holds no state of its own.
    """

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[str, type[BaseHeader]] = {}

    def __getitem__(self, name: str) -> type[BaseHeader]:
        key = name.lower()
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = super().__getitem__(name)
        return made

    def map_to_type(self, name: str, cls: type[BaseHeader]) -> None:
        super().map_to_type(name, cls)
        self._made.pop(name.lower(), None)


# email.policy.default, the EmailMessage default, with the classes kept.
MESSAGE_POLICY = default_policy.clone(header_factory=_HeaderClasses())


def encoded_subject(subject: str) -> str:
    """``subject`` folded as the Subject header, in encoded words where it must be.

    Not the email package's own folding (policy.default): where it splits a
    long subject into several encoded words it drops or doubles a space, so
    a long name arrived as another one. email.header.Header keeps every space
    inside an encoded word; set_raw keeps its lines as they are.
    """
    # Plain text that looks like an encoded word ("=?utf-8?q?...") would be
    # decoded by the reader.
    if subject.isascii() and "=?" not in subject:
        plain = Header(subject, "us-ascii", header_name="Subject").encode()
        if _fits_unfolded(plain):
            return plain
        # A word too long for a line: the policy would fold it its own way.
    return Header(subject, "utf-8", header_name="Subject").encode()


def _fits_unfolded(folded: str) -> bool:
    """Whether the policy sends ``folded``'s lines as they are (EmailPolicy._fold)."""
    limit = MESSAGE_POLICY.max_line_length or math.inf
    first, *rest = folded.splitlines() or [""]
    return len("Subject: " + first) <= limit and all(len(line) <= limit for line in rest)


def message_id(job_id: int, job_created_at: float, mail_from: str) -> str:
    """The Message-ID of a job's email, the same on every attempt of the job.

    The id alone is not enough: a restore from backup hands the ids issued
    since the backup out again, and a mailbox may drop a message whose
    Message-ID it has seen. The job's enqueue time (whole milliseconds) tells
    such a job from the one that had its id before.
    """
    domain = mail_from.rpartition("@")[2] or "localhost"
    return f"<job-{job_id}.{math.floor(job_created_at * 1000)}@{domain}>"


@dataclass(frozen=True)
class Email:
    job_id: int
    job_created_at: float  # the job's enqueue time (Job.created_at)
    mail_from: str
    to: tuple[str, ...]
    subject: str
    body: str
    # Structured log fields of the job behind this email (JOB_KIND, PRODUCT_ID, ...).
    fields: Mapping[str, object] = field(default_factory=dict)
    # Whom to send it to, when only some of ``to`` still need it (a server had
    # deferred them). Empty: everyone in ``to``.
    resend_to: tuple[str, ...] = ()

    @property
    def message_id(self) -> str:
        return message_id(self.job_id, self.job_created_at, self.mail_from)

    @property
    def recipients(self) -> tuple[str, ...]:
        """The envelope's recipients (RCPT TO)."""
        return self.resend_to or self.to

    def to_mime(self, now: float | None = None) -> EmailMessage:
        """The message, dated ``now`` (a Unix time; the current one by default)."""
        msg = EmailMessage(policy=MESSAGE_POLICY)
        msg["From"] = self.mail_from
        msg["To"] = ", ".join(self.to)
        # The email package refuses a header with a line break in it, and counts
        # U+2028/U+2029 as ones: a subject is one line, whatever text it quotes.
        msg.set_raw("Subject", encoded_subject(" ".join(self.subject.splitlines())))
        msg["Date"] = formatdate(now, localtime=False, usegmt=True)
        msg["Message-ID"] = self.message_id
        msg["X-Toko-Job-Id"] = str(self.job_id)
        msg.set_content(self.body)
        return msg

    def log_fields(self) -> dict[str, object]:
        fields = {
            **self.fields,
            "JOB_ID": self.job_id,
            "TO": ", ".join(self.to),
            "SUBJECT": self.subject,
            "MESSAGE_ID": self.message_id,
        }
        if self.resend_to:
            fields["RESEND_TO"] = ", ".join(self.resend_to)
        return fields
