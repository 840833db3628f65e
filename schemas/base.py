import msgspec


class Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Request bodies: unknown fields are an error, every field is named."""
