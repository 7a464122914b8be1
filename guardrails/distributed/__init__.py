"""Where this process sits in a job and how ranks talk outside the training's process
group: ranks, the side store, launch checks. Private.
"""
