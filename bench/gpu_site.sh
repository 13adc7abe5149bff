# Sourced by the bench/gpu_*.sh scripts: install_site installs the wheels carried beside the
# checkout (.whl/, which bench/gpu_wheels.sh fetches, and any folders named) into /tmp/site,
# once per machine and set of wheels, and sets what every bench run on the lent GPU shares:
# /tmp/site first on PYTHONPATH (the GPU image's own transformers and friends are other
# versions), unbuffered output, tracebacks on a fatal signal, no hub.
#
#   . bench/gpu_site.sh && install_site [WHEEL_FOLDER ...] || exit 1
install_site() {
  local files=() folder wheels
  for folder in .whl "$@"; do files+=("$folder"/*.whl); done
  wheels=$(ls "${files[@]}" | md5sum | cut -c1-12)
  [ -f /tmp/site/.wheels-$wheels ] || { rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --target /tmp/site "${files[@]}" && touch /tmp/site/.wheels-$wheels; } || return 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1
}
