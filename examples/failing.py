# %%
print("loading data")
rows = [3, 1, 4]

# %%
average = sum(rows) / (len(rows) - 3)  # ZeroDivisionError: the traceback comes back, earlier output is kept
