"""docs/manifest-schema.json is generated from the pydantic models and must not drift."""

import json
from pathlib import Path

from opd_store.manifest import manifest_json_schema


def test_committed_schema_matches_models():
    committed = json.loads((Path(__file__).parent.parent / "docs" / "manifest-schema.json").read_text())
    assert committed == manifest_json_schema(), (
        "regenerate with: python -c \"import json; from opd_store.manifest import manifest_json_schema; "
        "open('docs/manifest-schema.json','w').write(json.dumps(manifest_json_schema(), indent=2, sort_keys=True)+'\\n')\""
    )
