# An importable module with a function of no arguments, in this folder (ddpkit.launch imports it
# by name in each process it starts).
import os
import sys

with open("mymodule.py", "w") as module:
    module.write("import ddpkit\n\n\ndef work():\n    rt = ddpkit.init()\n    return rt.rank\n")
sys.path.insert(0, os.getcwd())
