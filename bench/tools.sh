# Sourced by the bench scripts: `need TOOL...` installs, from Debian's packages, each tool
# that is not on PATH (a fresh machine has none of wrk, nginx, valgrind), then checks again.

need() {
  local missing=() packages=() tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  for tool in "${missing[@]}"; do
    case "$tool" in
      redis-benchmark | redis-cli) packages+=(redis-tools) ;;
      nginx) packages+=(nginx-light) ;;
      callgrind_control) packages+=(valgrind) ;;
      *) packages+=("$tool") ;;
    esac
  done
  echo "bench: installing ${packages[*]} (for ${missing[*]})" >&2
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null; }; then
    echo "bench: could not install ${packages[*]}: install them, then run again" >&2
    exit 2
  fi
  for tool in "${missing[@]}"; do
    command -v "$tool" >/dev/null || { echo "bench: $tool not found on PATH after installing" >&2; exit 2; }
  done
}
