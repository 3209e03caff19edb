"""What each job kind does. Handlers raise to fail an attempt; the pool retries."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from service.mail import Mailer, RecipientsDeferred
from service.mail_message import Email
from service.models import Job, NewJob, PartlyDone, Product, job_fields

PRODUCT_EMAIL = "product_email"
PRICE_EMAIL = "price_email"
RECAP_EMAIL = "recap_email"
ALERT_EMAIL = "alert_email"


@dataclass(frozen=True)
class JobContext:
    mailer: Mailer
    mail_from: str
    admin_emails: tuple[str, ...]


Handler = Callable[[Job, JobContext], Awaitable[None]]


def product_email_job(
    product: Product, max_attempts: int, leased_for: float | None = None
) -> NewJob:
    payload = {"product_id": product.id, "nama": product.nama, "harga": product.harga}
    return NewJob(PRODUCT_EMAIL, payload, max_attempts, leased_for)


def price_email_job(
    before: Product, after: Product, max_attempts: int, leased_for: float | None = None
) -> NewJob | None:
    """The admin's email about a change of price; None when harga stays.

    A rename alone sends none: the shop's price list is what the admin
    watches, and a typo fixed is no news. The payload holds the product as
    the change left it, so the email says what was changed, whatever
    happens to the product afterwards (a second change, a delete).
    """
    if before.harga == after.harga:
        return None
    payload = {
        "product_id": after.id,
        "version": after.version,
        "nama": after.nama,
        "harga_lama": before.harga,
        "harga": after.harga,
    }
    if before.nama != after.nama:
        payload["nama_lama"] = before.nama
    return NewJob(PRICE_EMAIL, payload, max_attempts, leased_for)


def recap_email_job(period: str, total: int, new: int, max_attempts: int) -> NewJob:
    payload = {"period": period, "products_total": total, "products_new": new}
    return NewJob(RECAP_EMAIL, payload, max_attempts)


@dataclass(frozen=True)
class UnitFailure:
    """A systemd unit that failed, as toko-alert learns it (OnFailure=)."""

    unit: str
    host: str
    failed_at: str  # ISO-8601 UTC
    # systemd's MONITOR_SERVICE_RESULT / _EXIT_CODE / _EXIT_STATUS; empty when not given.
    result: str = ""
    exit_code: str = ""
    exit_status: str = ""

    def to_payload(self) -> dict[str, str]:
        return {
            "unit": self.unit,
            "host": self.host,
            "failed_at": self.failed_at,
            "result": self.result,
            "exit_code": self.exit_code,
            "exit_status": self.exit_status,
        }


def alert_email_job(failure: UnitFailure, max_attempts: int) -> NewJob:
    return NewJob(ALERT_EMAIL, failure.to_payload(), max_attempts)


def alert_subject(unit: str) -> str:
    return f"toko: {unit} failed"


def _rupiah(amount: int) -> str:
    return "Rp " + f"{amount:,}".replace(",", ".")


async def send_product_email(job: Job, ctx: JobContext) -> None:
    p = job.payload
    body = (
        f"Produk baru masuk.\n\n"
        f"ID:    {p['product_id']}\n"
        f"Nama:  {p['nama']}\n"
        f"Harga: {_rupiah(p['harga'])}\n"
    )
    await _email_admins(job, ctx, f"Produk baru: {p['nama']}", body)


async def send_price_email(job: Job, ctx: JobContext) -> None:
    p = job.payload
    renamed = f"Nama lama:  {p['nama_lama']}\n" if "nama_lama" in p else ""
    body = (
        f"Harga produk berubah.\n\n"
        f"ID:         {p['product_id']}\n"
        f"Nama:       {p['nama']}\n"
        f"{renamed}"
        f"Harga lama: {_rupiah(p['harga_lama'])}\n"
        f"Harga baru: {_rupiah(p['harga'])}\n"
    )
    await _email_admins(job, ctx, f"Harga berubah: {p['nama']}", body)


async def send_recap_email(job: Job, ctx: JobContext) -> None:
    p = job.payload
    body = (
        f"Rekap produk untuk {p['period']}.\n\n"
        f"Produk baru:   {p['products_new']}\n"
        f"Total produk:  {p['products_total']}\n"
    )
    await _email_admins(job, ctx, f"Rekap produk {p['period']}", body)


async def send_alert_email(job: Job, ctx: JobContext) -> None:
    p = job.payload
    unit = p["unit"]
    how = ", ".join(
        f"{name} {p[key]}"
        for name, key in (("result", "result"), ("exit", "exit_code"), ("status", "exit_status"))
        if p.get(key)
    )
    body = (
        f"{unit} failed on {p['host']} at {p['failed_at']}"
        + (f" ({how})" if how else "")
        + ".\n\n"
        + "What happened, and the next scheduled run:\n\n"
        + f"  journalctl -u {unit} -n 50 --no-pager\n"
        + f"  systemctl status {unit}\n"
        + "  systemctl list-timers 'toko-*'\n"
    )
    await _email_admins(job, ctx, alert_subject(unit), body)


async def _email_admins(job: Job, ctx: JobContext, subject: str, body: str) -> None:
    """Send the job's email to the admins, or to those a server had deferred."""
    # Kept in the payload once some admins have it: the To: line stays as it
    # was when the email was first sent, whatever the setting says since.
    to = tuple(job.payload.get("to") or ctx.admin_emails)
    email = Email(
        job_id=job.id,
        job_created_at=job.created_at,
        mail_from=ctx.mail_from,
        to=to,
        subject=subject,
        body=body,
        fields=job_fields(job),
        resend_to=tuple(job.payload.get("resend_to") or ()),
    )
    try:
        await ctx.mailer.send(email)
    except RecipientsDeferred as exc:
        left = {**job.payload, "to": list(to), "resend_to": list(exc.deferred)}
        raise PartlyDone(str(exc), left) from exc


HANDLERS: dict[str, Handler] = {
    PRODUCT_EMAIL: send_product_email,
    PRICE_EMAIL: send_price_email,
    RECAP_EMAIL: send_recap_email,
    ALERT_EMAIL: send_alert_email,
}
