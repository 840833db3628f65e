"""The demo report: a real PDF, one page per step, each step costing HERALD_REPORT_PAGE_MS."""

from __future__ import annotations

import asyncio

from fpdf import FPDF

from schemas import ReportParams
from schemas.problems import REPORT_RENDER_FAILED
from workers.context import JobContext
from workers.errors import JobFailed


def drawable(pdf: FPDF, text: str) -> str:
    """``text`` as the built-in fonts can draw it: a character they lack (an emoji, CJK,
    Arabic; they hold Latin-1) becomes ``?``. Any title SPEC §3 accepts (a str of 1..200)
    renders, where fpdf raised and the job failed as an internal error after its 202."""
    encoding = pdf.core_fonts_encoding
    return text.encode(encoding, errors="replace").decode(encoding)


async def run_report(ctx: JobContext, params: ReportParams) -> None:
    pdf = FPDF(format="A4")
    pdf.set_title(params.title)  # the document's metadata holds any character: the title as given
    heading = drawable(pdf, params.title)
    pdf.set_creator("Herald")
    page_s = ctx.settings.report_page_ms / 1000
    for page in range(1, params.pages + 1):
        await ctx.checkpoint()
        if params.fail_on_page == page:
            raise JobFailed(REPORT_RENDER_FAILED, f"rendering failed on page {page} of {params.pages} (fail_on_page)")
        if page_s:
            await asyncio.sleep(page_s)
        pdf.add_page()
        pdf.set_font("helvetica", "B", 20)
        pdf.cell(0, 12, heading, new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("helvetica", size=12)
        pdf.cell(0, 10, f"Page {page} of {params.pages}", new_x="LMARGIN", new_y="NEXT")
        await ctx.progress(page * 100 // params.pages)
        await ctx.emit({"page": page, "pages": params.pages})  # streamed output (SPEC §8)
    await asyncio.to_thread(pdf.output, str(ctx.output))
