# Installed as /etc/profile.d/alpa-kit-venv.sh: login shells (`bash -l`, whose /etc/profile resets PATH on
# Debian) see the image's Python environment too. Non-login shells (KubeRay's `bash -c`) get it from the
# image's ENV PATH.
case ":${PATH}:" in
  *:/opt/venv/bin:*) ;;
  *) PATH="/opt/venv/bin:${PATH}"; export PATH ;;
esac
