"""Unpack wheels (zips) into a target dir, keeping the executable bits (raylet, gcs_server)."""
import os
import sys
import zipfile

target = sys.argv[1]
for path in sys.argv[2:]:
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            dest = z.extract(info, target)
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                os.chmod(dest, mode & 0o777)
print("unpacked", len(sys.argv) - 2, "archives into", target)
