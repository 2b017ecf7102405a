"""Reading a multipart/form-data upload (POST /v1/files) with every part bounded as it streams.

Starlette's form parser bounds only text fields (`max_part_size`) and spools file parts to disk
whatever their size, so a large file is written out before any limit applies. Here a file part is
kept in memory (it goes to Redis anyway) and refused as soon as it passes `max_file_bytes`; text
fields, their number and part headers are bounded too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

MAX_FIELD_BYTES = 64 * 1024  # a text field (`purpose`) is a word
MAX_FIELDS = 4
MAX_FILES = 1
MAX_HEADER_BYTES = 16 * 1024  # one part's headers


class UploadRefused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    file_field: str | None = None
    filename: str | None = None
    content: bytes | None = None


@dataclass
class _Part:
    header_bytes: int = 0
    disposition: bytes = b""
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


class _Reader:
    def __init__(self, max_file_bytes: int) -> None:
        self.max_file_bytes = max_file_bytes
        self.upload = Upload()
        self.part = _Part()
        self.header_name = bytearray()
        self.header_value = bytearray()
        self.files = self.fields = 0

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes(end - start)
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes(end - start)
        self.header_value += data[start:end]

    def _header_bytes(self, n: int) -> None:
        self.part.header_bytes += n
        if self.part.header_bytes > MAX_HEADER_BYTES:
            raise UploadRefused(400, f"a part's headers are longer than {MAX_HEADER_BYTES} bytes")

    def on_header_end(self) -> None:
        if bytes(self.header_name).lower() == b"content-disposition":
            self.part.disposition = bytes(self.header_value)
        self.header_name.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.part.disposition)
        if b"name" not in options:
            raise UploadRefused(400, "every part needs a Content-Disposition with a name")
        self.part.name = _text(options[b"name"])[:100]
        if b"filename" in options:
            self.files += 1
            if self.files > MAX_FILES:
                raise UploadRefused(400, f"at most {MAX_FILES} file part", param="file")
            self.part.filename = _text(options[b"filename"])[:255]
        else:
            self.fields += 1
            if self.fields > MAX_FIELDS:
                raise UploadRefused(400, f"at most {MAX_FIELDS} form fields")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        size = len(self.part.data) + end - start
        if self.part.filename is not None and size > self.max_file_bytes:
            raise UploadRefused(413, f"the file is larger than {self.max_file_bytes:,} bytes "
                                "(gateway.max_file_bytes)", param="file")
        if self.part.filename is None and size > MAX_FIELD_BYTES:
            raise UploadRefused(413, f"form field '{self.part.name}' is longer than {MAX_FIELD_BYTES} bytes",
                                param=self.part.name)
        self.part.data += data[start:end]

    def on_part_end(self) -> None:
        if self.part.filename is None:
            self.upload.fields[self.part.name] = _text(bytes(self.part.data))
        else:
            self.upload.file_field, self.upload.filename = self.part.name, self.part.filename
            self.upload.content = bytes(self.part.data)


async def read_upload(content_type: str, body: AsyncIterator[bytes], *, max_file_bytes: int) -> Upload:
    """The form's text fields and its one file, read from `body` chunk by chunk; UploadRefused
    (413 as soon as a part passes its limit, 400 for a malformed form)."""
    media, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if media != b"multipart/form-data" or not boundary:
        raise UploadRefused(415, "the body must be multipart/form-data with a boundary")
    reader = _Reader(max_file_bytes)
    callbacks = {name: getattr(reader, name) for name in (
        "on_part_begin", "on_header_field", "on_header_value", "on_header_end", "on_headers_finished",
        "on_part_data", "on_part_end")}
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        async for chunk in body:
            if chunk:
                parser.write(chunk)
        parser.finalize()
    except (FormParserError, ValueError) as e:
        raise UploadRefused(400, f"malformed multipart body: {_text(str(e).encode())[:200]}") from None
    return reader.upload
