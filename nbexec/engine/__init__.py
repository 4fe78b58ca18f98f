"""The one engine: a Session drives a sandbox through the seam and builds every result.

    session   Session: the only code that runs cells and builds results (local or any other source)
    execute   execute_notebook(): a throwaway Session, as nbclient's execute() wraps NotebookClient
    many      execute_many(): many execute_notebook() runs, a few at a time, streamed, stopped as one
    judge     judge(): a program against tests in one sandbox; judgemany: many programs, in few sandboxes with
              reuse="batch". judgerunner, judgecompare, judgeinit, judgechecker, judgereset and judgefork (the
              fork server of Python tests) are shipped into it as text and run there; judgevalues holds what
              a caller passes and gets
    cells     the cell loop (tags, deadlines, failures)
    budget    kernel messages turned into outputs within the output allowance, the failure kept whatever it cost
    widgets   widget models from the kernel's comm messages, within the budget, saved in the notebook (pure)
    collect   what a run left turned into one ExecutionResult: images, /mnt/data, uploads, links
    manager   SessionManager: sessions by id, with a cap
    reaper    idle sessions closed after their TTL; every live one closed at exit

May import: nbexec's values (config, errors, result), notebook, files, stores, packages, sandbox (the seam and its
sources). Nothing below imports the engine.
"""
