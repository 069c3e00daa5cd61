"""JSON that other tools read: the files (`dump_json`, valid JSON with null where a
figure is missing) and the ``--json-log`` (`JsonLog`, JSON lines in NVIDIA
dllogger's record layout).

Python's ``json`` writes a float NaN or infinity as a bare ``NaN`` or
``Infinity``, which is not JSON (``JSON.parse`` and ``jq`` reject the file);
every JSON this script writes goes through `finite` first and is dumped with
``allow_nan=False``, so such a value can only be ``null``.
"""
import datetime
import json
import math
import os
import time

# The units of the --json-log's figures, as dllogger's METADATA records give them.
UNITS = {'train.loss': None, 'train.ips': 'images/s', 'train.lr': None,
         'train.loss_scale': None, 'train.skipped_steps': 'steps', 'train.time': 's',
         'val.accuracy': None, 'val.top_k_accuracy_5': None, 'val.ips': 'images/s'}


def finite(value):
    """`value` with every float that is not finite (in dicts, lists and tuples) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dump_json(value, handle):
    """Write `value` to the open text file `handle` as valid JSON (indented)."""
    json.dump(finite(value), handle, indent=1, allow_nan=False)


class JsonLog(object):
    """The ``--json-log``: one JSON object per line, dllogger's ``JSONStreamBackend``
    records without their ``DLLL `` prefix.

    Each record is ``{"timestamp": seconds since the epoch, "datetime": local time
    with its offset, "elapsedtime": seconds since the log was opened, "type":
    "LOG" or "METADATA", ...}``; a ``LOG`` has ``"step"`` (``"PARAMETER"``,
    ``[epoch, iteration]``, ``[epoch]`` or ``[]``) and ``"data"``, a
    ``METADATA`` has ``"metric"`` and ``"metadata"`` (``{"unit": ...}``).  Each
    line goes to the file in one ``write`` on a descriptor opened for appending,
    so a reader (or a run killed meanwhile) never sees half a record.

    Parameters
    ----------
    path : str
        The file; its directory is created.
    append : bool
        Continue the file (a resumed run) rather than start it anew.
    """

    def __init__(self, path, append):
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self._fd = os.open(path, flags, 0o666)
        self._opened = time.time()
        for metric, unit in UNITS.items():
            self._write({'type': 'METADATA', 'metric': metric, 'metadata': {'unit': unit}})

    def log(self, step, data):
        """Write one ``LOG`` record: `step` as dllogger takes it, `data` figure by name."""
        self._write({'type': 'LOG', 'step': list(step) if isinstance(step, tuple) else step,
                     'data': data})

    def _write(self, record):
        now = time.time()
        stamp = datetime.datetime.fromtimestamp(now).astimezone()
        line = json.dumps(finite(dict({'timestamp': now, 'datetime': str(stamp),
                                       'elapsedtime': now - self._opened}, **record)),
                          allow_nan=False) + '\n'
        data = line.encode('utf-8')
        while data:   # one write takes it all; a short one (a full disk) writes the rest
            data = data[os.write(self._fd, data):]

    def close(self):
        os.close(self._fd)
