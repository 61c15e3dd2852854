"""docs/manifest-schema.json is generated from the pydantic models and must not drift."""

import json
from pathlib import Path

from opd_store.format import manifest_json_schema


def test_committed_schema_matches_models():
    committed = json.loads((Path(__file__).parent.parent / "docs" / "manifest-schema.json").read_text())
    assert committed == manifest_json_schema(), (
        "regenerate with: python -c \"import json; from opd_store.format._manifest import manifest_json_schema; "
        "open('docs/manifest-schema.json','w').write(json.dumps(manifest_json_schema(), indent=2, sort_keys=True)+'\\n')\""
    )


# The canonical JSON schema of each manifest format version, by SHA-256. A change to the
# pydantic models changes the schema: it must come with a new MANIFEST_FORMAT_VERSION and a new
# entry here (the entries of earlier versions stay, so readers of old manifests are not forgotten),
# plus the regenerated docs/manifest-schema.json.
SCHEMA_SHA256_BY_FORMAT_VERSION = {
    1: "d546170bb0b1652e49ac54ca85da91556cce1be29308a06bd02d1f3035509920",
    2: "d0bb8f224f31b08484f478ad37586cf2fefb2549c2682a0004a14b6c39b52940",
}


def test_a_model_change_needs_a_format_version_bump():
    import hashlib

    from opd_store.format._manifest import MANIFEST_FORMAT_VERSION

    canonical = json.dumps(manifest_json_schema(), sort_keys=True, separators=(",", ":")).encode("utf-8")
    digest = hashlib.sha256(canonical).hexdigest()
    assert MANIFEST_FORMAT_VERSION in SCHEMA_SHA256_BY_FORMAT_VERSION, (
        f"format version {MANIFEST_FORMAT_VERSION} has no recorded schema: add {digest!r}"
    )
    assert digest == SCHEMA_SHA256_BY_FORMAT_VERSION[MANIFEST_FORMAT_VERSION], (
        f"the manifest models changed (schema sha256 {digest}) but MANIFEST_FORMAT_VERSION is still "
        f"{MANIFEST_FORMAT_VERSION}: bump it, record the new digest here, regenerate docs/manifest-schema.json"
    )
