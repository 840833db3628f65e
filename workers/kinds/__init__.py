"""The built-in job kinds. Register your own here the same way."""

from schemas import ExportParams, ReportParams
from workers.kinds.export import export_media_type, export_suffix, run_export
from workers.kinds.report import run_report
from workers.registry import JobKind, register

register(
    JobKind(
        name="report",
        params=ReportParams,
        collection="/reports",
        handler=run_report,
        media_type=lambda _params: "application/pdf",
        suffix=lambda _params: ".pdf",
        media_types=("application/pdf",),
    )
)
register(
    JobKind(
        name="export",
        params=ExportParams,
        collection="/exports",
        handler=run_export,
        media_type=export_media_type,
        suffix=export_suffix,
        media_types=("text/csv", "application/x-ndjson"),
    )
)
