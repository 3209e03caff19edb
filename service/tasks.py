"""What each job kind does. Handlers raise to fail an attempt; the pool retries."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from service.mail import Email, Mailer
from service.models import Job, NewJob, Product

PRODUCT_EMAIL = "product_email"
RECAP_EMAIL = "recap_email"


@dataclass(frozen=True)
class JobContext:
    mailer: Mailer
    mail_from: str
    admin_email: str


Handler = Callable[[Job, JobContext], Awaitable[None]]


def product_email_job(product: Product, max_attempts: int) -> NewJob:
    payload = {"product_id": product.id, "nama": product.nama, "harga": product.harga}
    return NewJob(PRODUCT_EMAIL, payload, max_attempts)


def recap_email_job(period: str, total: int, new: int, max_attempts: int) -> NewJob:
    payload = {"period": period, "products_total": total, "products_new": new}
    return NewJob(RECAP_EMAIL, payload, max_attempts)


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
    await ctx.mailer.send(
        Email(
            job_id=job.id,
            mail_from=ctx.mail_from,
            to=ctx.admin_email,
            subject=f"Produk baru: {p['nama']}",
            body=body,
            fields=job_fields(job),
        )
    )


async def send_recap_email(job: Job, ctx: JobContext) -> None:
    p = job.payload
    body = (
        f"Rekap produk untuk {p['period']}.\n\n"
        f"Produk baru:   {p['products_new']}\n"
        f"Total produk:  {p['products_total']}\n"
    )
    await ctx.mailer.send(
        Email(
            job_id=job.id,
            mail_from=ctx.mail_from,
            to=ctx.admin_email,
            subject=f"Rekap produk {p['period']}",
            body=body,
            fields=job_fields(job),
        )
    )


HANDLERS: dict[str, Handler] = {
    PRODUCT_EMAIL: send_product_email,
    RECAP_EMAIL: send_recap_email,
}


def job_fields(job: Job) -> dict[str, object]:
    """Structured log fields for a job (journal fields under systemd)."""
    fields: dict[str, object] = {"JOB_ID": job.id, "JOB_KIND": job.kind, "ATTEMPT": job.attempts}
    if "product_id" in job.payload:
        fields["PRODUCT_ID"] = job.payload["product_id"]
    return fields
