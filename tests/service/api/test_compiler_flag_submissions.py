"""A tree whose optdrift.toml carries a compiler flag off the allow-list (issue 43) is bad input at
submission: 422 naming the field and the flag, on the commit route and the verify route (an archive
and a patch that adds the flag), and nothing is recorded. The real app over the real database."""

from __future__ import annotations

from pathlib import Path

from service.core.archives import pack_directory
from tests.service_fixtures import make_archive

GOOD_TOML = '[build]\nkind = "torch-extension"\ncflags = ["-O2"]\n'
WRAPPER_TOML = '[build]\nkind = "torch-extension"\ncflags = ["-O2", "-wrapper", "sh,src/wrap.h"]\n'
WRAP_SCRIPT = "#!/bin/sh\ntouch /tmp/optdrift-wrapped\nexec \"$@\"\n"
NAMED = "build.cflags[1] '-wrapper' is not an allowed compiler flag"


def _submit(api, sha: str, archive: bytes):  # noqa: ANN001, ANN202
    return api.post("/api/v1/projects/kern/commits", data={"sha": sha},
                    files={"archive": ("s.tar.gz", archive, "application/gzip")})


def test_a_tree_with_a_wrapper_flag_is_refused_at_submission_naming_it(api, tmp_path: Path):  # noqa: ANN001
    assert api.post("/api/v1/projects", json={"name": "kern"}).status_code == 201
    bad_tree = {"optdrift.toml": WRAPPER_TOML, "src/wrap.h": WRAP_SCRIPT, "ops.cpp": "// kernels\n"}
    refused = _submit(api, "wrapped", make_archive(bad_tree))
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert NAMED in detail and "optdrift.toml" in detail and "allowed are" in detail, detail
    assert api.get("/api/v1/projects/kern/commits/wrapped").status_code == 404  # nothing was recorded

    tree = tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    (tree / "optdrift.toml").write_text(GOOD_TOML)
    (tree / "ops.cpp").write_text("// kernels\n")
    (tree / "src" / "wrap.h").write_text(WRAP_SCRIPT)
    assert _submit(api, "ok", pack_directory(tree)).status_code == 201, "the same tree with -O2 is taken"

    verify = api.post("/api/v1/projects/kern/verify", data={"base": "ok"},
                      files={"archive": ("t.tar.gz", make_archive(bad_tree))})
    assert verify.status_code == 422 and NAMED in verify.json()["detail"], verify.text
    patch = ("--- a/optdrift.toml\n+++ b/optdrift.toml\n@@ -3 +3 @@\n"
             '-cflags = ["-O2"]\n+cflags = ["-O2", "-wrapper", "sh,src/wrap.h"]\n').encode()
    patched = api.post("/api/v1/projects/kern/verify", data={"base": "ok"}, files={"patch": ("p.diff", patch)})
    assert patched.status_code == 422 and NAMED in patched.json()["detail"], patched.text
    nvcc = make_archive({**bad_tree, "optdrift.toml": '[build]\nkind = "torch-extension"\n'
                                                      'cuda_cflags = ["-Xcompiler", "-wrapper"]\n'})
    refused_nvcc = _submit(api, "nvccwrapped", nvcc)
    assert refused_nvcc.status_code == 422, refused_nvcc.text
    assert "build.cuda_cflags[0] '-Xcompiler' is not an allowed compiler flag" in refused_nvcc.json()["detail"]
