"""Repository rule exposing jax.ffi.include_dir() (the XLA FFI headers) as @jax_ffi//:headers."""

def _python(ctx):
    if "PYTHON_BIN_PATH" in ctx.os.environ:
        return ctx.os.environ["PYTHON_BIN_PATH"]
    venv = ctx.path(Label("@//custom_calls:BUILD")).dirname.dirname.get_child(".venv").get_child("bin").get_child("python")
    return str(venv) if venv.exists else "python3"

def _jax_ffi_headers_impl(ctx):
    python = _python(ctx)
    result = ctx.execute([python, "-c", "import jax; print(jax.ffi.include_dir())"])
    if result.return_code != 0:
        fail("cannot import jax with %s (set PYTHON_BIN_PATH): %s" % (python, result.stderr))
    ctx.symlink(result.stdout.strip(), "include")
    ctx.file("BUILD", """filegroup(
    name = "headers",
    srcs = glob(["include/xla/ffi/api/*.h"]),
    visibility = ["//visibility:public"],
)
""")

jax_ffi_headers = repository_rule(
    implementation = _jax_ffi_headers_impl,
    environ = ["PYTHON_BIN_PATH"],
    local = True,
)
